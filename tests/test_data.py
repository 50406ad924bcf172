"""Standard-library text data: file list, splits, byte tokens and the deterministic batch iterator."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from memsched.data import HOLDOUT_EVERY, VOCAB_SIZE, batches, load_stdlib_corpus, stdlib_files, stdlib_root
from tests._numerics import same


def _write_tree(root: Path, n: int) -> list[bytes]:
    """n small .py files (two in a sub-folder) plus files to ignore; returns the contents in sorted order."""
    contents = {}
    for i in range(n):
        rel = f"pkg/m{i:03d}.py" if i >= n - 2 else f"m{i:03d}.py"
        data = f"# file {i}\nx = {i}\n".encode()
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
        contents[rel] = data
    for skipped in ("site-packages/a.py", "dist-packages/b.py", "__pycache__/c.py", "notes.txt"):
        (root / skipped).parent.mkdir(parents=True, exist_ok=True)
        (root / skipped).write_bytes(b"SKIPPED")
    return [contents[k] for k in sorted(contents)]


def test_stdlib_files_are_sorted_python_sources_without_installed_packages() -> None:
    files = stdlib_files()
    root = stdlib_root()
    rel = [f.relative_to(root).as_posix() for f in files]
    assert rel == sorted(rel)
    assert all(r.endswith(".py") for r in rel)
    assert not any(part in ("site-packages", "dist-packages") for r in rel for part in r.split("/"))
    assert "os.py" in rel and "json/__init__.py" in rel
    assert stdlib_files() == files  # deterministic


def test_split_holds_out_every_20th_file(tmp_path: Path) -> None:
    contents = _write_tree(tmp_path, 45)
    corpus = load_stdlib_corpus(None, root=tmp_path)
    held = [i for i in range(45) if i % HOLDOUT_EVERY == HOLDOUT_EVERY - 1]
    assert held == [19, 39]
    assert bytes(corpus.val.tolist()) == b"".join(contents[i] for i in held)
    assert bytes(corpus.train.tolist()) == b"".join(c for i, c in enumerate(contents) if i not in held)
    assert corpus.files == 45
    assert corpus.train.dtype == torch.uint8
    assert corpus.split("val") is corpus.val
    with pytest.raises(ValueError, match="'test'"):
        corpus.split("test")


def test_max_bytes_reads_whole_files_in_order(tmp_path: Path) -> None:
    contents = _write_tree(tmp_path, 45)
    limit = sum(len(c) for c in contents[:30]) - 1  # stops after file 29 (files are read whole)
    corpus = load_stdlib_corpus(limit, root=tmp_path)
    assert corpus.files == 30
    assert corpus.train.numel() + corpus.val.numel() == sum(len(c) for c in contents[:30])


def test_bad_inputs(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_stdlib_corpus(root=tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="no .py files"):
        load_stdlib_corpus(root=tmp_path)
    _write_tree(tmp_path, 5)
    with pytest.raises(ValueError, match="too small"):
        load_stdlib_corpus(root=tmp_path)  # 5 files: no held-out file
    for bad in (0, -3, 1.5, True):
        with pytest.raises(ValueError, match="max_bytes"):
            load_stdlib_corpus(bad, root=tmp_path)  # type: ignore[arg-type]


def test_real_stdlib_corpus_is_text_bytes() -> None:
    corpus = load_stdlib_corpus(2 * 2**20)
    assert corpus.train.numel() >= 2 * 2**20 * 0.8 and corpus.val.numel() > 0
    ascii_share = (corpus.train < 128).float().mean().item()
    assert ascii_share > 0.99  # Python source is (almost) all ASCII
    assert int(corpus.train.max()) < VOCAB_SIZE


def test_batches_shapes_shift_and_windows() -> None:
    tokens = torch.randint(0, 256, (1000,), generator=torch.Generator().manual_seed(3)).to(torch.uint8)
    out = list(batches(tokens, 4, 16, seed=5, steps=3))
    assert len(out) == 3
    for x, y in out:
        assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == torch.int64
        torch.testing.assert_close(x[:, 1:], y[:, :-1])
        text = bytes(tokens.tolist())
        for row_x, row_y in zip(x, y, strict=True):
            window = bytes(row_x.tolist()) + bytes(row_y[-1:].tolist())
            assert window in text


def test_batches_are_deterministic_in_the_seed() -> None:
    tokens = torch.randint(0, 256, (5000,), generator=torch.Generator().manual_seed(0)).to(torch.uint8)
    a = [x for x, _ in batches(tokens, 2, 8, seed=1, steps=4)]
    b = [x for x, _ in batches(tokens, 2, 8, seed=1, steps=4)]
    c = [x for x, _ in batches(tokens, 2, 8, seed=2, steps=4)]
    assert all(same(p, q) for p, q in zip(a, b, strict=True))
    assert not all(same(p, q) for p, q in zip(a, c, strict=True))


def test_batches_endless_without_steps_and_bad_arguments_fail_at_the_call() -> None:
    tokens = torch.zeros(100, dtype=torch.uint8)
    it = batches(tokens, 1, 10)
    assert all(next(it)[0].shape == (1, 10) for _ in range(50))
    with pytest.raises(ValueError, match="batch_size"):
        batches(tokens, 0, 10)
    with pytest.raises(ValueError, match="seq_len"):
        batches(tokens, 1, -1)
    with pytest.raises(ValueError, match="steps"):
        batches(tokens, 1, 10, steps=0)
    with pytest.raises(ValueError, match="at least seq_len \\+ 1 = 101"):
        batches(tokens, 1, 100)

"""Real text without downloads: the Python standard library's own source files, as byte-level tokens.

The corpus is every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]`` (``site-packages``,
``dist-packages`` and ``__pycache__`` excluded), in sorted path order, each read as bytes; a token is one byte
(vocab 256), so any machine with Python has the data. Every 20th file (by sorted position) is held out for
validation, so the two splits never share a file.

Batches are random windows drawn with a seeded ``torch.Generator``: the same ``(seed, batch, seq_len)`` gives
the same batches on every machine that has the same Python version.
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

VOCAB_SIZE = 256
HOLDOUT_EVERY = 20  # file i is held out when i % HOLDOUT_EVERY == HOLDOUT_EVERY - 1
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def stdlib_root() -> Path:
    """The standard library folder of the running Python."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: str | os.PathLike[str] | None = None) -> list[Path]:
    """Sorted ``*.py`` files under ``root`` (default :func:`stdlib_root`), skipping installed packages.

    Raises:
        FileNotFoundError: ``root`` is not a folder or holds no ``.py`` file.
    """
    base = Path(root) if root is not None else stdlib_root()
    if not base.is_dir():
        raise FileNotFoundError(f"text folder {str(base)!r} does not exist")
    found: list[Path] = []
    for folder, dirs, files in os.walk(base):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS]  # prune: site-packages can be huge
        found.extend(Path(folder) / f for f in files if f.endswith(".py"))
    if not found:
        raise FileNotFoundError(f"no .py files under {str(base)!r}")
    return sorted(found, key=lambda p: p.relative_to(base).as_posix())


@dataclass(frozen=True)
class TextCorpus:
    """Byte tokens of the train and validation splits.

    Attributes:
        train: ``[n_train]`` uint8 tensor of byte tokens.
        val: ``[n_val]`` uint8 tensor of byte tokens.
        files: files read (both splits).
    """

    train: torch.Tensor
    val: torch.Tensor
    files: int

    def split(self, name: str) -> torch.Tensor:
        """The ``"train"`` or ``"val"`` tokens.

        Raises:
            ValueError: any other name.
        """
        if name not in ("train", "val"):
            raise ValueError(f"unknown split {name!r}: expected 'train' or 'val'")
        return self.train if name == "train" else self.val


def load_stdlib_corpus(max_bytes: int | None = 8 * 2**20, *,
                       root: str | os.PathLike[str] | None = None) -> TextCorpus:
    """Read the standard library sources into a :class:`TextCorpus`.

    Args:
        max_bytes: stop after reading about this many bytes (whole files, in sorted order); ``None`` reads all
            (about 30 MiB on CPython 3.11). Default 8 MiB: plenty for a demo, read in well under a second.
        root: folder to read instead of the standard library (tests use a small one).

    Raises:
        ValueError: ``max_bytes`` is not a positive int, or a split ends up empty.
        FileNotFoundError: see :func:`stdlib_files`.
    """
    if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int)
                                  or max_bytes <= 0):
        raise ValueError(f"max_bytes must be a positive number of bytes or None, got {max_bytes!r}")
    train, val = bytearray(), bytearray()
    files = 0
    for i, path in enumerate(stdlib_files(root)):
        if max_bytes is not None and len(train) + len(val) >= max_bytes:
            break
        try:
            data = path.read_bytes()
        except OSError:  # unreadable file (permissions, broken link): skip it, the rest is still text
            continue
        (val if i % HOLDOUT_EVERY == HOLDOUT_EVERY - 1 else train).extend(data)
        files += 1
    if not train or not val:
        raise ValueError(f"text corpus too small: {len(train)} train and {len(val)} validation bytes "
                         f"from {files} files; need at least {HOLDOUT_EVERY} non-empty files")
    return TextCorpus(train=_as_tensor(train), val=_as_tensor(val), files=files)


def _as_tensor(data: bytearray) -> torch.Tensor:
    return torch.frombuffer(data, dtype=torch.uint8)


def batches(tokens: torch.Tensor, batch_size: int, seq_len: int, seed: int = 0,
            *, steps: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Random next-token windows from ``tokens``: yields ``(inputs, targets)``, both ``[batch_size, seq_len]``
    int64 on the CPU, ``targets`` shifted one token right of ``inputs``.

    Deterministic in ``seed``; endless unless ``steps`` is given.

    Raises:
        ValueError: non-positive ``batch_size``/``seq_len``/``steps``, or ``tokens`` shorter than ``seq_len +
        1``.
    """
    for name, value in (("batch_size", batch_size), ("seq_len", seq_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps <= 0):
        raise ValueError(f"steps must be a positive int or None, got {steps!r}")
    if tokens.dim() != 1 or tokens.numel() < seq_len + 1:
        raise ValueError(f"need a 1-D token tensor of at least seq_len + 1 = {seq_len + 1} tokens, "
                         f"got shape {tuple(tokens.shape)}")
    return _windows(tokens, batch_size, seq_len, seed, steps)  # validated eagerly, generated lazily


def _windows(tokens: torch.Tensor, batch_size: int, seq_len: int, seed: int,
             steps: int | None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    offsets = torch.arange(seq_len + 1)
    n = 0
    while steps is None or n < steps:
        starts = torch.randint(0, tokens.numel() - seq_len, (batch_size, 1), generator=gen)
        window = tokens[starts + offsets].long()  # [batch, seq_len + 1]
        yield window[:, :-1].contiguous(), window[:, 1:].contiguous()
        n += 1

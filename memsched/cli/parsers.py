"""The sub-commands' argument parsers, apart from the commands themselves so that ``memsched --help`` (and
``memsched COMMAND --help``) stays quick: nothing here imports torch, rich or the tracer. Each command's work
is ``run(args)`` in :mod:`memsched.cli.<name>`, imported only when the command runs (see
:mod:`memsched.cli.main`).

Values a help text or a choice needs come from torch-free modules (:mod:`memsched.models.presets`,
:mod:`memsched.devices.gpus`, :mod:`policies.units`) or are declared here and checked against their torch-side
definition by the tests (``ATTENTION``).
"""

from __future__ import annotations

import argparse
import shlex
import textwrap
from collections.abc import Callable

from memsched.cli.argtypes import bandwidth, positive_float, positive_int, positive_int_list, ratio
from memsched.devices.gpus import gpu_names
from memsched.models.llama import LLAMA_PRESETS
from memsched.models.presets import sizes
from policies.units import parse_positive_bytes
from policies.update_paths import HOST_UPDATE_MODES

# ---- shared ------------------------------------------------------------------------------------------------
TARGET_HELP = """\
TARGET is path/to/file.py:function or package.module:function. memsched calls
function(device) with a torch.device; it must return (model, loss_fn), or
memsched.target.Workload(model, loss_fn), where model is an nn.Module on that
device and loss_fn(model) builds one batch on the device and returns a scalar
loss. memsched then runs loss.backward() and the optimizer step. The device
may be a fake CUDA device under FakeTensorMode (memsched plan), so create
tensors on the given device. Example:

  def build(device):
      model = MyNet().to(device)
      def loss_fn(m):
          x = torch.randn(32, 128, device=device)
          return m(x).square().mean()
      return model, loss_fn

  memsched trace examples/trace_target.py:build --steps 2
"""


class MovedValueFlag(argparse.Action):
    """A flag that used to take a value: ``memsched trace --json FILE`` wrote the timeline there; that option
    is ``--timeline FILE`` now and ``--json`` a flag. Given a value (``--json FILE`` or ``--json=FILE``) it
    fails with a message naming the new option, instead of leaving FILE to the parser's "unrecognized
    arguments".

    The flag takes an optional value (``nargs="?"``) only to catch that; :class:`HelpFormatter` shows it as
    the plain flag it is.
    """

    def __init__(self, option_strings: list[str], dest: str, *, moved_to: str, what: str, does: str,
                 help: str | None = None) -> None:
        super().__init__(option_strings, dest, nargs="?", const=True, default=False, help=help)
        self.moved_to, self.what, self.does = moved_to, what, does

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: str | bool | None, option_string: str | None = None) -> None:
        if values is not True:  # without a value argparse passes the const, True
            raise argparse.ArgumentError(
                self, f"takes no value (got {values!r}): {self.what} moved to {self.moved_to} FILE, so write "
                      f"{self.moved_to} {shlex.quote(str(values))}; {option_string} now {self.does} (if "
                      f"{values!r} is the TARGET, put {option_string} after it)")
        setattr(namespace, self.dest, True)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """``RawDescriptionHelpFormatter`` that shows a :class:`MovedValueFlag` as a flag (``[--json]``)."""

    def _format_args(self, action: argparse.Action, default_metavar: str) -> str:
        if isinstance(action, MovedValueFlag):
            return ""
        return super()._format_args(action, default_metavar)


def add_json_flag(p: argparse.ArgumentParser, help: str) -> None:
    """``--json``: print the command's report as one JSON document on stdout instead of text. Every command
    that prints a report has it (``tests/test_cli_json.py`` checks)."""
    p.add_argument("--json", action="store_true", help=help)


def add_export_options(p: argparse.ArgumentParser, *, with_timeline: bool) -> None:
    """The per-file export options (``--perfetto F`` ...) of ``trace`` and ``report``."""
    if with_timeline:
        p.add_argument("--timeline", metavar="FILE",
                       help="timeline JSON path (default: OUT/trace.json; was --json FILE before)")
    p.add_argument(
        "--perfetto", metavar="FILE", help="Chrome/Perfetto trace-event JSON (open in ui.perfetto.dev)"
    )
    p.add_argument(
        "--memory-viz",
        dest="memory_viz",
        metavar="FILE",
        help="pickled PyTorch memory snapshot (open in pytorch.org/memory_viz)",
    )
    p.add_argument("--png", metavar="FILE", help="stacked-area plot by category (needs 'memsched[plot]')")


# ---- demo --------------------------------------------------------------------------------------------------
DEMO_SIZE = "demo"
DEMO_STEPS = 20
DEMO_BATCH_SIZE = 8
DEMO_SEQ_LEN = 256
DEMO_LR = 1e-3
DEMO_OUT = "memsched-out/demo"


def add_demo(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "demo",
        help="train a GPT on the Python standard library's sources under memsched (trace, plan, offload)",
        description="Train the built-in GPT on byte-level text (this Python's standard library sources; no "
                    "download) with memsched: the first step is traced, a placement policy splits the "
                    "optimizer state between the device and pinned CPU memory, and training goes on with the "
                    "hybrid AdamW. Without a GPU a stand-in device (sim:SIZE) is sized so that the optimizer "
                    "state does not all fit. Prints a progress bar (log lines when the output is not a "
                    "terminal), the memory report and the plan, and writes the exports.",
    )
    p.add_argument("--size", default=DEMO_SIZE, help=f"GPT size (default {DEMO_SIZE}): {', '.join(sizes())}")
    p.add_argument("--policy", default="auto", help="placement policy (default auto; see memsched policies)")
    p.add_argument("--gpu-margin-mem-ratio", type=ratio, default=0.8, metavar="R",
                   help="share of the GPU margin the policy may fill, in [0, 1] (default 0.8)")
    p.add_argument("--device", default=None,
                   help="cuda, cuda:N, cpu, sim:SIZE (e.g. sim:64MiB) or sim (sized automatically); default: "
                        "cuda when available, else an automatically sized stand-in")
    p.add_argument("--steps", type=positive_int, default=DEMO_STEPS,
                   help=f"training steps (default {DEMO_STEPS})")
    p.add_argument("--batch-size", type=positive_int, default=DEMO_BATCH_SIZE,
                   help=f"sequences per step (default {DEMO_BATCH_SIZE})")
    p.add_argument("--seq-len", type=positive_int, default=DEMO_SEQ_LEN,
                   help=f"tokens (bytes) per sequence (default {DEMO_SEQ_LEN})")
    p.add_argument("--lr", type=positive_float, default=DEMO_LR,
                   help=f"AdamW learning rate (default {DEMO_LR:g})")
    p.add_argument("--seed", type=int, default=0, help="seed of the model's initialisation and the batches")
    p.add_argument("--overlap", nargs="?", const=True, default=False, choices=["backward"],
                   metavar="backward",
                   help="update offloaded chunks on a CPU thread while the next forward runs (attach(overlap="
                        "True)); '--overlap backward': they start during backward "
                        "(attach(overlap='backward')); the report's step-time table shows the exposed CPU "
                        "time")
    p.add_argument("--out", default=DEMO_OUT, help=f"output folder for the exports (default {DEMO_OUT})")
    add_json_flag(p, "print the report, the plan, the run's figures and where the exports went as one JSON "
                     "document on stdout instead of the text report (the progress goes to stderr)")
    return p


# ---- trace -------------------------------------------------------------------------------------------------
def add_trace(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "trace",
        help="trace the memory of a few training steps of TARGET; print the report and write exports",
        description="Run --steps training steps of TARGET under memsched's memory tracer, print the report "
        "and write the timeline JSON, a Perfetto trace, a PyTorch memory_viz snapshot and a PNG "
        "(when matplotlib is installed) to --out.",
        epilog=TARGET_HELP,
        formatter_class=HelpFormatter,
    )
    p.add_argument("target", metavar="TARGET", help="path/to/file.py:function or package.module:function")
    p.add_argument("--steps", type=positive_int, default=2, help="training steps to trace (>= 1, default: 2)")
    p.add_argument("--device", default=None, help="device to train on (default: cuda if available, else cpu)")
    p.add_argument(
        "--optimizer",
        choices=("adamw", "none"),
        default="adamw",
        help="adamw: torch.optim.AdamW, so optimizer states appear in the trace (default); "
        "none: backward only",
    )
    p.add_argument("--lr", type=positive_float, default=1e-3, help="AdamW learning rate (default: 1e-3)")
    p.add_argument(
        "--backend",
        choices=("auto", "tensor", "cuda"),
        default="auto",
        help="how the tracer measures: cuda (allocator statistics), tensor (tracks tensors; any "
        "device), auto (cuda on CUDA, else tensor; the default)",
    )
    p.add_argument(
        "--out",
        default="memsched-out/trace",
        metavar="DIR",
        help="folder for the exports (default: memsched-out/trace; created if missing): the timeline JSON, "
        "the Perfetto trace, the memory_viz snapshot and the PNG, named trace.*; existing files are replaced",
    )
    add_export_options(p, with_timeline=True)
    p.add_argument("--top", type=positive_int, default=10, help="modules to list in the report (default: 10)")
    p.add_argument("--quiet", action="store_true", help="do not print the report, only where files went")
    p.add_argument("--json", action=MovedValueFlag, moved_to="--timeline", what="the timeline JSON's path",
                   does="prints the report as JSON on stdout",
                   help="print the report and where the exports went as one JSON document on stdout instead "
                        "of text (the timeline JSON's path is --timeline FILE)")
    return p


# ---- report ------------------------------------------------------------------------------------------------
def add_report(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "report",
        help="re-render a saved timeline (memsched trace's JSON) and optionally re-export it",
        description="Print the memory report of a timeline saved by `memsched trace` (its .json file); "
        "--perfetto/--memory-viz/--png also write those exports.",
    )
    p.add_argument("file", metavar="FILE.json", help="timeline JSON written by `memsched trace`")
    p.add_argument("--top", type=positive_int, default=10, help="modules to list (default: 10)")
    add_export_options(p, with_timeline=False)
    add_json_flag(p, "print the report (and where any exports went) as one JSON document on stdout instead "
                     "of text")
    return p


# ---- plan --------------------------------------------------------------------------------------------------
PLAN_BATCH_SIZE = 8
PLAN_SEQ_LEN = 1024
#: ``--dtype`` name -> the torch dtype's name (``memsched.cli.plan.DTYPES`` maps them to torch dtypes).
DTYPE_NAMES: dict[str, str] = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
#: ``--attention`` choices: :data:`memsched.planning.prediction.ATTENTION` (a test keeps the two equal).
ATTENTION = ("gpu", "default", "math")


def capacity_size(text: str) -> int:
    """A byte size > 0 (``24GiB``, ``1.5e9``; :func:`policies.units.parse_positive_bytes`)."""
    try:
        return parse_positive_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_plan(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "plan",
        help="predict a training step's memory with fake tensors (no GPU needed) and plan placement",
        description=textwrap.fill(
            "Build the model and run forward + backward of one batch under FakeTensorMode (no memory is "
            "allocated), then show peak non-model data, model data by category, each placement policy's plan "
            "for the device size, and a verdict: fits / fits only with offload / fits only with parameters "
            "on the host / does not fit; with --model, the largest preset that fits.", 79),
        epilog="examples: memsched plan --model 1.3b --batch-size 8 --seq-len 1024 --capacity 24GiB\n"
               "          memsched plan --model 2.7b --batch-size 1 --capacity 13GiB --host-memory 128GiB\n"
               "          memsched plan --model 1.3b --seq-len 512,1024,2048 --gpu a100-40gb\n"
               "          memsched plan --model 1.3b --world-size 4 --gpu a100-40gb\n"
               "          memsched plan --model small --stages 2 --stage 0 --micro-batches 4 --schedule 1f1b "
               "--capacity 2GiB\n"
               "          memsched plan examples/trace_target.py:build --gpu a100-40gb --json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("target", nargs="?", metavar="TARGET",
                   help="file.py:function or module:function returning (model, loss_fn) for a device "
                        "(see memsched trace); or use --model")
    p.add_argument("--model", metavar="SIZE",
                   help=f"the built-in GPT at this size: {', '.join(sizes())}; or a Llama-class shape built "
                        f"with transformers (random weights): {', '.join(LLAMA_PRESETS)}, the path of a "
                        "Hugging Face config.json (or its folder), or a model id transformers resolves")
    p.add_argument("--checkpointing", action="store_true",
                   help="with a Llama-class --model: activation checkpointing, as Hugging Face's "
                        "gradient_checkpointing_enable() does")
    p.add_argument("--lora", type=positive_int, default=None, metavar="RANK",
                   help="with --model: freeze the model and train rank-RANK LoRA adapters on its "
                        "feed-forward layers (the frozen base is model data of its own, offloaded first)")
    p.add_argument("--batch-size", type=positive_int_list, default=None, metavar="N[,N...]",
                   help=f"batch size for --model (default {PLAN_BATCH_SIZE}); several, comma-separated, "
                        "plan each and say the largest that fits")
    p.add_argument("--seq-len", type=positive_int_list, default=None, metavar="N[,N...]",
                   help=f"sequence length for --model (default {PLAN_SEQ_LEN}, at most the model's "
                        "block size); several, comma-separated, plan each and say the largest that fits")
    p.add_argument("--dtype", choices=sorted(DTYPE_NAMES), default=None,
                   help="compute dtype (bf16/fp16 add an fp32 master copy to the optimizer state); default: "
                        "fp32 for --model, the model's own dtype for a TARGET")
    p.add_argument("--capacity", type=capacity_size, metavar="SIZE",
                   help="device capacity, e.g. 24GiB; with --gpu, that GPU capped to it (as "
                        "torch.cuda.set_per_process_memory_fraction caps it)")
    p.add_argument("--gpu", metavar="NAME", help=f"a named GPU: {', '.join(gpu_names())}")
    p.add_argument("--gpu-margin-mem-ratio", type=ratio, default=0.8, metavar="R",
                   help="share of the GPU margin policies may fill, in [0, 1] (default 0.8)")
    p.add_argument("--host-memory", type=capacity_size, default=None, metavar="SIZE",
                   help="host memory the pinned chunks may take on the training machine, e.g. 128GiB "
                        "(default: the memory available here, cgroup limits included)")
    p.add_argument("--policy", default="auto", help="policy the verdict uses (default auto)")
    p.add_argument("--cpu-adam-rate", type=positive_float, default=None, metavar="ELEMENTS_PER_S",
                   help="fused CPU AdamW throughput of the training host, elements/s, for the predicted step "
                        "(default: measured on this machine)")
    p.add_argument("--host-update", choices=HOST_UPDATE_MODES, default="cpu",
                   help="where the host chunks' optimizer update runs, as attach(host_update=...): cpu "
                        "(default), device (their state streamed through the GPU), or auto (per chunk, "
                        "whichever lowers the step's update time: the CPU rate against the link's bandwidth)")
    p.add_argument("--link-bandwidth", type=bandwidth, default=None, metavar="BYTES_PER_S",
                   help="with --host-update: the host link's bandwidth per direction, e.g. 25GBps (default: "
                        "the --gpu's nominal PCIe x16 bandwidth)")
    p.add_argument("--world-size", type=positive_int, default=None, metavar="N",
                   help="also predict one rank's device peak at each ZeRO stage with N >= 2 data-parallel "
                        "ranks (the batch is per rank; one size only)")
    p.add_argument("--stages", type=positive_int, default=None, metavar="S",
                   help="with --model (a GPT size) and --micro-batches: plan one pipeline stage of the GPT "
                        "cut into S stages (docs/pipeline.md)")
    p.add_argument("--stage", type=int, default=None, metavar="I",
                   help="with --stages: the stage to plan, 0 (embeddings) to S-1 (head)")
    p.add_argument("--micro-batches", type=positive_int, default=None, metavar="N",
                   help="with --stages: the batch is split into N micro-batches, run in --schedule's order, "
                        "so the trace holds every micro-batch in flight at once")
    p.add_argument("--schedule", choices=("gpipe", "1f1b"), default="1f1b",
                   help="with --micro-batches: the pipeline schedule (default 1f1b: at most S - I "
                        "micro-batches in flight; gpipe: all N)")
    p.add_argument("--attention", choices=ATTENTION, default="gpu",
                   help="attention kernel of the trace: the one a CUDA GPU runs (default; without a GPU here "
                        "it is chosen as on one), torch's default for the traced device, or math (keeps the "
                        "[batch, heads, seq, seq] attention matrix)")
    p.add_argument("--largest-preset", action=argparse.BooleanOptionalAction, default=True,
                   help="with --model and one size: also find the largest GPT preset that fits at this batch "
                        "and sequence length (a few more fake traces; default on)")
    add_json_flag(p, "print the result as JSON (see result_dict)")
    return p


# ---- policies ----------------------------------------------------------------------------------------------
def add_policies(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "policies",
        help="list the placement policies and their options",
        description="List the registered placement policies, one line each, with their options.",
    )
    p.add_argument("--verbose", "-v", action="store_true", help="also print each option's help")
    add_json_flag(p, "print machine-readable JSON instead")
    return p


#: Sub-command -> the function adding its parser, in the order ``memsched --help`` lists them.
PARSERS: dict[str, Callable[[argparse._SubParsersAction], argparse.ArgumentParser]] = {
    "demo": add_demo,
    "trace": add_trace,
    "report": add_report,
    "plan": add_plan,
    "policies": add_policies,
}

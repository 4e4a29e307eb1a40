# SPDX-License-Identifier: Apache-2.0
"""One GPU check in this process: ``python -m tests.gpu.run_check NAME``.

Run by the bundle's entry script after it installed the bundle; prints the
device, driver, torch, Triton and vLLM versions, then the check's lines,
then PASS or FAIL with every problem found.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

from tests.gpu import standins

FINDER = standins.install()
os.environ.setdefault("HUMMING_DISABLE_PARALLEL_BUILD", "1")

import torch  # noqa: E402

standins.stand_in_op_probes()
standins.stand_in_activation_ops()


def header() -> None:
    import triton

    import vllm

    driver = subprocess.run(
        ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    print(
        f"device: {torch.cuda.get_device_name()}; driver {driver}; "
        f"torch {torch.__version__}; triton {triton.__version__}; "
        f"vllm {vllm.__version__} from {os.path.dirname(vllm.__file__)}; "
        f"python {sys.version.split()[0]}"
    )


def single_rank() -> None:
    """One rank, gloo: vLLM's groups exist (graph capture asks them); no
    collective of more than one rank runs."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import (
        init_distributed_environment,
        initialize_model_parallel,
    )

    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            backend="gloo",
            distributed_init_method="tcp://127.0.0.1:29531",
        )
        initialize_model_parallel(1, 1)


def float64_rms_norm(self, x, residual=None):
    """RMSNorm in the input's dtype. vLLM's native ``rms_norm`` and
    ``fused_add_rms_norm`` compute in float32 whatever the input, so a
    float64 model rounds there, differently on each device."""
    assert self.variance_size_override is None
    if residual is not None:
        x = x + residual
        residual = x
    out = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.variance_epsilon)
    if self.has_weight:
        out = out * self.weight
    return out if residual is None else (out, residual)


def outputs_by_module(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every module's first output tensor, by name, in the order they run."""
    seen: dict[str, torch.Tensor] = {}

    def keep(name):
        def hook(module, args, output):
            first = output[0] if isinstance(output, tuple) else output
            if isinstance(first, torch.Tensor):
                seen[name] = first.detach().cpu()

        return hook

    for name, module in model.named_modules():
        module.register_forward_hook(keep(name or "model"))
    return seen


def tiny_k3() -> list[str]:
    """The tiny K3 in float64 on CUDA against the same model on the CPU:
    with vLLM's own norms (float32 inside, so float32-close) and with the
    norms computed in float64 (a stand-in, said so: then every other op of
    the model must agree to float64 rounding)."""
    from unittest import mock

    from tests.sppp_testbed import tiny_k3 as bed
    from tests.sppp_testbed.stages import token_ids
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.layernorm import RMSNorm

    problems = []
    real_stream = torch.cuda.Stream
    for norms in ("vllm", "float64"):
        patch = (
            mock.patch.object(RMSNorm, "forward_native", float64_rms_norm)
            if norms == "float64"
            else contextlib.nullcontext()
        )
        for attn_res in (False, True):
            for num_tokens in (1, 7, 33):
                config = bed.scenario_config(1, 1, sp=False, attn_res=attn_res)
                with (
                    patch,
                    set_current_vllm_config(config),
                    bed.stand_ins(),
                    torch.no_grad(),
                ):
                    # The test bed stubs CUDA streams out for the CPU; here
                    # the real ones must stay (vLLM's native ops use them).
                    torch.cuda.Stream = real_stream
                    reference_model = bed.build_model(config, seed=3)
                    cuda_model = bed.build_model(config, seed=3).to("cuda")
                    trace = num_tokens == 7 and not attn_res
                    if trace:
                        on_cpu = outputs_by_module(reference_model)
                        on_cuda = outputs_by_module(cuda_model)
                    ids = token_ids(num_tokens, seed=3)
                    positions = torch.arange(num_tokens)
                    reference = reference_model(ids, positions, None)
                    with torch.device("cuda"):
                        output = cuda_model(ids.cuda(), positions.cuda(), None)
                if isinstance(reference, tuple):
                    reference, output = reference[0], output[0]
                error = (output.cpu() - reference).abs().max().item()
                scale = reference.abs().max().item()
                # float64 rounding with float64 norms; float32 rounding
                # (2**-23 relative, a few ulps over 4 layers) with vLLM's.
                bound = 1e-9 if norms == "float64" else 1e-5 * max(1.0, scale)
                ok = output.is_cuda and output.dtype == torch.float64 and error <= bound
                print(
                    f"tiny K3 (4 layers, AttnRes {'on' if attn_res else 'off'}, "
                    f"{norms} norms), N={num_tokens}: CUDA {tuple(output.shape)} "
                    f"{output.dtype}, max |ref| {scale:.3g}, max |CUDA - CPU| = "
                    f"{error:.2e} (bound {bound:.0e}): {'ok' if ok else 'MISMATCH'}"
                )
                if trace:
                    first = [
                        f"{name} {(on_cuda[name] - t).abs().max().item():.1e}"
                        for name, t in on_cpu.items()
                        if name in on_cuda
                        and on_cuda[name].shape == t.shape
                        and (on_cuda[name] - t).abs().max().item() > 1e-12
                    ][:4]
                    print(f"  modules first differing over 1e-12: {first or 'none'}")
                if not ok:
                    problems.append(
                        f"{norms} norms, AttnRes={attn_res} N={num_tokens}: "
                        f"error {error} over {bound}"
                    )
    return problems


def graphs() -> list[str]:
    from tests.gpu import checks

    with checks.declared_topology():
        stage = checks.capture_graphs(torch.device("cuda"))
        print(
            f"real torch.cuda.CUDAGraph objects: "
            f"{sorted(type(g).__name__ for g in stage.manager.graphs.values())[:1]}"
        )
        return checks.check_graph_replay(stage, print)


def legacy_graphs() -> list[str]:
    import vllm
    from tests.gpu import checks
    from tests.sppp_testbed.bases import HAS_LEGACY_RUNNER

    if not HAS_LEGACY_RUNNER:
        return [f"vLLM {vllm.__version__} has no legacy runner (0.33.0 only)"]
    with checks.declared_topology():
        stage = checks.capture_legacy_graphs(torch.device("cuda"))
        problems = checks.check_legacy_graph_replay(stage, print)
        print("--- planted: the legacy hand-over without its copy")
        planted = checks.check_legacy_graph_replay(
            stage, print, hand_over=lambda buffers, received, n, hand_off: buffers[:n]
        )
        print(f"planted fault caught: {bool(planted)}; its problems: {planted}")
        if not planted:
            problems.append("the planted hand-over without its copy passed")
    return problems


def execute_model() -> list[str]:
    from tests.gpu import checks
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    with checks.declared_topology():
        stage = checks.capture_graphs(torch.device("cuda"))
        problems = checks.check_execute_model(
            stage, GPUModelRunner.execute_model, print
        )
        print("--- planted: execute_model with the hand-over skipped on FULL replay")
        planted = checks.check_execute_model(
            stage, checks.execute_model_skipping_full_hand_over(), print
        )
        print(f"planted fault caught: {bool(planted)}; its problems: {planted}")
        if not planted:
            problems.append("the planted skip of the FULL hand-over passed")
    return problems


def main() -> int:
    name = sys.argv[1]
    header()
    single_rank()
    problems = {
        "tiny-k3": tiny_k3,
        "graphs": graphs,
        "legacy-graphs": legacy_graphs,
        "execute-model": execute_model,
    }[name]()
    print(f"stand-ins imported: {FINDER.used}")
    print(f"{name}: {'PASS' if not problems else 'FAIL'}")
    for problem in problems:
        print(f"  problem: {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

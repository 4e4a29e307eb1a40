# SPDX-License-Identifier: Apache-2.0
"""``vllm serve`` with the stand-in worker: a model directory, a server."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import warnings
from pathlib import Path

from tests.sppp_testbed import k3_checkpoint, tiny_k3
from tests.sppp_testbed.bases import HAS_LEGACY_RUNNER

ROOT = Path(__file__).resolve().parents[2]
PLUGINS = Path(__file__).resolve().parent / "plugins"
VLLM = Path(sys.executable).with_name("vllm")
EOS = 0


CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"


def write_model_dir(path: Path, architecture: str | None = None) -> Path:
    """The served model directory with a character-level tokenizer and a
    chat template. On vLLM 0.34.0, the tiny Kimi K3 checkpoint of
    ``k3_checkpoint.write_checkpoint`` with ``architecture`` (K3's name by
    default; vLLM's registry and loader build the class it names). On
    0.33.0, whose servers run a stand-in runner that builds the tiny K3
    itself, a Llama-shaped ``config.json`` that the engine only sizes its
    config from."""
    if not HAS_LEGACY_RUNNER:
        k3_checkpoint.write_checkpoint(
            path, architecture or k3_checkpoint.ARCHITECTURES[0]
        )
        # The served context (GSM8K's 5-shot prompts) and the chat template.
        k3_checkpoint.write_tokenizer(path, 4096, chat_template=CHAT_TEMPLATE)
        return path
    k3_checkpoint.write_tokenizer(path, 4096, chat_template=CHAT_TEMPLATE)
    (path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "vocab_size": tiny_k3.VOCAB,
                "hidden_size": tiny_k3.HIDDEN,
                "intermediate_size": 96,
                "num_hidden_layers": tiny_k3.NUM_LAYERS,
                "num_attention_heads": 4,
                "num_key_value_heads": 4,
                "max_position_embeddings": 4096,
                "eos_token_id": EOS,
                "bos_token_id": 1,
                "torch_dtype": "float32",
                # EP needs experts; the tiny K3 has 4.
                "num_local_experts": 4,
            }
        )
    )
    return path


# What every test server runs with, after ``vllm serve DIR --port PORT``;
# a layout's options follow and win where they repeat one.
SERVE_ARGS = [
    "--served-model-name", "tiny-k3",
    "--worker-cls", "tests.serving.worker.Worker",
    "--load-format", "dummy",
    "--distributed-executor-backend", "mp",
    "--enforce-eager",
    "--no-async-scheduling",
    "--dtype", "float32",
    # GSM8K's 5-shot prompts are about 1,000 characters, one token each.
    "--max-model-len", "2048",
    "--max-num-seqs", "8",
    "--kv-cache-memory-bytes", str(64 << 20),
]  # fmt: skip
if not HAS_LEGACY_RUNNER:
    # vLLM 0.34.0 serving Kimi K3 on the CPU platform: MLA makes the platform
    # turn prefix caching off (and chunked prefill, and sets 16-token blocks)
    # after the hybrid-model hook sized the KDA state for caching, which the
    # config then refuses ("--mamba-block-size can only be set with
    # --enable-prefix-caching"): off from the start. vLLM's native torch ops
    # (the CPU ones are vllm._C's, which the CUDA wheel lacks). The tests'
    # character-level tokenizer and its chat template in place of Kimi K3's
    # own (tokenizer mode "kimi_k3", which vLLM picks for the class: its
    # renderer in the Rust frontend formats chats its own way).
    SERVE_ARGS += [
        "--no-enable-prefix-caching",
        "--tokenizer-mode", "hf",
        "--compilation-config", json.dumps({"custom_ops": ["none"]}),
    ]  # fmt: skip


# The classes the test servers serve: the target's (config.json above, by each
# name a layout serves) and the drafter's, as vLLM's ``eagle3`` method names it
# (tests/serving/eagle3.py).
SERVED_ARCHITECTURES = (
    ("LlamaForCausalLM", "Eagle3LlamaForCausalLM")
    if HAS_LEGACY_RUNNER
    else (*k3_checkpoint.ARCHITECTURES, "Eagle3LlamaForCausalLM")
)


def cache_model_info(architectures=SERVED_ARCHITECTURES) -> None:
    """Fill vLLM's model-info cache (``VLLM_CACHE_ROOT/modelinfos``) for the
    served classes, once, before the servers start.

    ``vllm serve`` inspects each class it serves (``_LazyRegisteredModel.
    inspect_model_cls``, vllm/model_executor/models/registry.py); on a cache
    miss it does so in a new Python process that imports vLLM and torch
    again, 15 to 20 s of CPU: on a machine that never served them, every
    server of the tests at once, the drafter layouts twice in a row. Here
    vLLM's own inspection runs once, in a fork of this process (which has
    imported vLLM), with that new process's work done in the fork; vLLM
    writes the cache, and every server reads it as a node that served the
    class before does. With the cache already filled, nothing runs."""
    context = multiprocessing.get_context("fork")
    process = context.Process(target=_inspect, args=(list(architectures),))
    process.start()
    process.join()
    if process.exitcode != 0:  # each server then inspects the classes itself
        warnings.warn(
            f"vLLM's model-info cache not filled (exit {process.exitcode}): "
            "every server inspects its classes in a process of its own",
            stacklevel=2,
        )


def _inspect(architectures: list[str]) -> None:
    from vllm.model_executor.models import registry

    registry._run_in_subprocess = lambda inspect: inspect()
    for name in architectures:
        registry.ModelRegistry.models[name].inspect_model_cls()


# The tests download nothing: the model directory and GSM8K are local.
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def serve_env() -> dict[str, str]:
    """The environment of a test server: the CPU platform, this checkout on
    the path (for ``--worker-cls``) with the entry point of
    :mod:`tests.serving.fork_processes`, and on vLLM 0.33.0 the V1 runner the
    stand-in replaces (0.34.0 has no other runner than V2 and refuses the
    variable set to anything but 1; its CPU worker builds the one the
    stand-in replaces)."""
    import vllm.envs

    path = [str(ROOT), str(PLUGINS), os.environ.get("PYTHONPATH", "")]
    runner = {}
    if "VLLM_USE_V2_MODEL_RUNNER" in vllm.envs.environment_variables:
        runner["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    return dict(
        os.environ,
        VLLM_TARGET_DEVICE="cpu",
        PYTHONPATH=os.pathsep.join(path),
        VLLM_CPU_OMP_THREADS_BIND="nobind",
        **runner,
    )


class Server:
    """One ``vllm serve`` process; its log in ``log``. ``vllm`` is the command
    run as ``vllm``: vLLM's own, or tests/serving/preloaded_vllm.py's."""

    def __init__(
        self,
        model_dir: Path,
        port: int,
        args: list[str],
        env: dict[str, str] | None = None,
        log: Path | None = None,
        vllm: Path = VLLM,
    ):
        self.url = f"http://127.0.0.1:{port}"
        self.log = log or model_dir / f"serve-{port}.log"
        self.command = [
            str(vllm),
            "serve",
            str(model_dir),
            "--port",
            str(port),
            *SERVE_ARGS,
            *args,
        ]
        environ = dict(serve_env(), **(env or {}))
        # The served name the command gives last: what requests must name.
        words = self.command
        self.model = [
            words[i + 1] for i, w in enumerate(words) if w == "--served-model-name"
        ][-1]
        self.started = time.monotonic()
        with open(self.log, "wb") as out:
            self.process = subprocess.Popen(
                self.command,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=environ,
                cwd=ROOT,
                start_new_session=True,
            )
        # When it exits, however late it is asked.
        self._exited: float | None = None
        self._watcher = threading.Thread(target=self._watch, daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        self.process.wait()
        self._exited = time.monotonic()

    def seconds_to_exit(self) -> float:
        """Seconds from start to the process's exit, waiting for it."""
        self._watcher.join()
        return self._exited - self.started

    def wait_ready(self, timeout: float = 420) -> float:
        """Seconds from start to the first healthy answer; the log's tail if
        the server exits or is not healthy ``timeout`` s after its start."""
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"vllm serve exited {self.process.returncode}:\n"
                    + self.log.read_text()[-6000:]
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2):
                    return time.monotonic() - self.started
            except OSError:
                if time.monotonic() - self.started > timeout:
                    break
                time.sleep(1)
        self.stop()
        raise TimeoutError(
            f"vllm serve not ready in {timeout} s:\n{self.log.read_text()[-6000:]}"
        )

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, 15)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, 9)
                self.process.wait()

    def post(self, endpoint: str, timeout: float = 120, **fields) -> dict:
        body = json.dumps(
            {
                "model": self.model,
                "temperature": 0,
                "ignore_eos": True,
                "skip_special_tokens": False,
                **fields,
            }
        ).encode()
        request = urllib.request.Request(
            self.url + endpoint, body, {"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return json.load(response)
        except urllib.error.HTTPError as error:
            raise RuntimeError(
                f"{endpoint} answered {error.code}; the server's log says:\n"
                + "\n".join(self.errors())
            ) from error

    def errors(self, limit: int = 12) -> list[str]:
        """The log's last error lines: what failed in a worker or the engine."""
        lines = self.log.read_text(errors="replace").splitlines()
        found = [line for line in lines if "rror" in line or "what():" in line]
        return [line[:400] for line in found[-limit:]]

    def complete(self, prompt: str, max_tokens: int, timeout: float = 120) -> str:
        """Greedy text through ``/v1/completions``."""
        answer = self.post(
            "/v1/completions", timeout, prompt=prompt, max_tokens=max_tokens
        )
        return answer["choices"][0]["text"]

    def chat(self, content: str, max_tokens: int) -> str:
        """Greedy text through ``/v1/chat/completions``: one user message,
        which the test tokenizer's chat template renders as ``content + "\\n"``."""
        answer = self.post(
            "/v1/chat/completions",
            messages=[{"role": "user", "content": content}],
            max_tokens=max_tokens,
        )
        return answer["choices"][0]["message"]["content"]

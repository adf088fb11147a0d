"""Mutation check of `vlite leak-check`: plant defects of our own, one at a time, and count how
many the default command and `--scenario all` catch.

Each mutant is a textual patch of one engine source file, applied to a temporary copy of the
`vlite` package (never to this tree); the leak check then runs from that copy in a fresh
process (the editable install's import hook is removed, so the copy really is what runs).
None of them is one of the `--inject-fault` faults. A mutant is *caught* when the command
exits 1 (LEAK or ZOMBIE); for the default command the script also shows what the report
blamed (the leaked blocks' owner actions and sites, or the registries, zombies, anomalies).
The clean tree is run the same way first: both commands must exit 0 (no false positive).
A mutant marked ``expect_clean`` (a bounded cache) is no defect: the default command must exit 0
on it too, and it is counted apart from the catches.

A mutant of the serving layers (``mode="serve"``: the engine loop, the async client, the API
server's metrics) is run as the docs say for a server: `vlite serve` from the patched copy,
then `leak-check --url` with the default command's workload (no `--scenario all`: it runs in
process); the clean tree is served and checked the same way when such a mutant is chosen.

A mutant of a mode that the default command does not take (``args``: ``-tp 2`` for a worker
process's state, ``--workload kind-waves`` for growth per request kind) runs the default
command with those flags added, as the docs give it for that mode; the clean tree is run with
the same flags first.

The model is a tiny random Llama with SmolLM2's tokenizer (built once under --workdir), whose
EOS ids are set to tokens its greedy decoding of the chat prompts produces, so that EOS finishes
happen as on an instruction-tuned model. The default command is the README's with a smaller
workload: `leak-check --num-requests 60 --abort-rate 0.3 --abort-mode mix`.

    .venv/bin/python benchmarks/leak_check/mutants.py [--only NAME ...] [--workdir /tmp/vlite-mutants] [--json out.json]

Bounded: the default command has a 300 s timeout, `--scenario all` 900 s; on a 2-core machine the whole run takes minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_ARGS = ["--num-requests", "60", "--abort-rate", "0.3", "--abort-mode", "mix"]


@dataclass(frozen=True)
class Mutant:
    """One planted defect: replace ``old`` (exactly once) by ``new`` in ``path`` (under vlite/)."""

    name: str
    path_area: str  # the engine path it breaks
    what: str
    path: str
    old: str
    new: str
    mode: str = "in-process"  # "serve": `vlite serve` from the patched copy, then `leak-check --url`
    args: tuple[str, ...] = ()  # added to the default command: the command the docs give for its mode (-tp 2, ...)
    expect_clean: bool = False  # not a defect: the default command must exit 0 (a bounded cache)


MUTANTS = [
    Mutant("free-skips-first-block", "free", "free() releases every block but the first of a table",
           "engine/core/kv_cache_manager.py", "        for block_id in reversed(table):\n",
           "        for block_id in reversed(table[1:]):\n"),
    Mutant("free-skips-shared-blocks", "free / prefix cache", "free() skips blocks shared with another sequence",
           "engine/core/kv_cache_manager.py",
           "            self._release(block_id, seq)\n        return len(table)",
           "            if self.blocks[block_id].ref_count > 1:\n                continue\n"
           "            self._release(block_id, seq)\n        return len(table)"),
    Mutant("prefix-hit-evictable-count", "allocation (prefix hit)",
           "taking a cached block on a prefix hit forgets to decrement the evictable count",
           "engine/core/block_pool.py",
           "            self.free_block_queue.remove(block_id)\n            self.num_evictable -= 1\n",
           "            self.free_block_queue.remove(block_id)\n"),
    Mutant("evict-keeps-index-entry", "prefix cache", "evicting a cached block keeps its hash-index entry",
           "engine/core/block_pool.py",
           "            if self.cached_blocks.get(block.block_hash) == block.block_id:\n"
           "                del self.cached_blocks[block.block_hash]\n", ""),
    Mutant("hash-progress-not-dropped", "free / prefix cache",
           "free() keeps the sequence's prefix-hash progress entry", "engine/core/kv_cache_manager.py",
           "        self._num_hashed.pop(seq.seq_id, None)\n        if self.ledger.enabled:",
           "        if self.ledger.enabled:"),
    Mutant("fork-no-incref-last-block", "fork", "fork() takes no reference on the last (partial) block",
           "engine/core/kv_cache_manager.py", "        for block_id in table:\n            self.blocks[block_id].ref_count += 1\n",
           "        for block_id in table:\n            if block_id != table[-1]:\n"
           "                self.blocks[block_id].ref_count += 1\n"),
    Mutant("fork-shares-table-list", "fork", "fork() gives the child the parent's block-table list itself",
           "engine/core/kv_cache_manager.py", "        table = list(self.block_tables.get(parent.seq_id, ()))\n",
           "        table = self.block_tables.setdefault(parent.seq_id, [])\n"),
    Mutant("cow-keeps-source", "copy-on-write", "copy-on-write replaces the table entry without releasing the source",
           "engine/core/kv_cache_manager.py", "            self._release(src, seq, \"copy-on-write\")\n", ""),
    Mutant("cow-double-release", "copy-on-write", "copy-on-write releases the source block twice",
           "engine/core/kv_cache_manager.py", "            self._release(src, seq, \"copy-on-write\")\n",
           "            self._release(src, seq, \"copy-on-write\")\n            self._release(src, seq, \"copy-on-write\")\n"),
    Mutant("preempt-in-prefill-drops-table", "preemption",
           "preempting a sequence that has no output token yet drops its table without a free",
           "engine/core/scheduler.py", "        self.kv_cache_manager.free(seq)\n        seq.status = SequenceStatus.PREEMPTED",
           "        if seq.num_output_tokens == 0:\n            self.kv_cache_manager.block_tables.pop(seq.seq_id, None)\n"
           "        else:\n            self.kv_cache_manager.free(seq)\n        seq.status = SequenceStatus.PREEMPTED"),
    Mutant("stop-string-no-free", "finish (stop string)", "a stop-string finish skips the release",
           "engine/core/scheduler.py", "            self.kv_cache_manager.free(seq)\n            req = self.requests[seq.request_id]",
           "            if not isinstance(stop_reason, str):\n                self.kv_cache_manager.free(seq)\n"
           "            req = self.requests[seq.request_id]"),
    Mutant("eos-no-free", "finish (EOS)", "an EOS finish skips the release", "engine/core/scheduler.py",
           "            self.kv_cache_manager.free(seq)\n            req = self.requests[seq.request_id]",
           "            if not (reason is FinishReason.STOP and stop_reason is None and seq.output_token_ids\n"
           "                    and seq.output_token_ids[-1] in seq.eos_token_ids):\n                self.kv_cache_manager.free(seq)\n"
           "            req = self.requests[seq.request_id]"),
    Mutant("stop-token-keeps-entry", "finish (stop token)", "a stop-token finish keeps the request's entry",
           "engine/core/scheduler.py", "            req.live.remove(seq)\n            if not req.live:",
           "            if isinstance(stop_reason, int):\n                return\n            req.live.remove(seq)\n"
           "            if not req.live:"),
    Mutant("beam-prune-not-finished", "beam search", "a pruned beam is dropped from the search but never finished",
           "engine/core/scheduler.py",
           "                self.finish_sequence(parent, FinishReason.STOP, kind=\"stop:beam_pruned\")  # pruned",
           "                pass"),
    Mutant("abort-prefill-drops-table", "abort (prefill)",
           "aborting a sequence still in its prefill drops the table without a free", "engine/core/scheduler.py",
           "            self.kv_cache_manager.free(seq)\n            req = self.requests[seq.request_id]",
           "            if reason is FinishReason.ABORT and seq.in_prefill and not seq.output_token_ids:\n"
           "                self.kv_cache_manager.block_tables.pop(seq.seq_id, None)\n            else:\n"
           "                self.kv_cache_manager.free(seq)\n            req = self.requests[seq.request_id]"),
    Mutant("abort-resumed-no-free", "abort (after preemption)",
           "aborting a resumed sequence (preempted, then running again) skips the release", "engine/core/scheduler.py",
           "            self.kv_cache_manager.free(seq)\n            req = self.requests[seq.request_id]",
           "            if not (reason is FinishReason.ABORT and seq.num_preemptions and seq.num_computed_tokens):\n"
           "                self.kv_cache_manager.free(seq)\n            req = self.requests[seq.request_id]"),
    Mutant("abort-first-sample-only", "abort (n > 1)",
           "abort() ends only the request's first sequence; its other samples decode on (zombies)",
           "engine/core/scheduler.py",
           "        for seq in seqs:  # every sequence, even when one's release raises (n > 1, beams)\n",
           "        for seq in seqs[:1]:\n"),
    # State outside the registry list, and host memory (found by the census, the
    # recorded paths and the host-memory plateau test, not by the block counts)
    Mutant("holdback-kept-after-stop-string", "per-request state (unregistered)",
           "the output processor keeps a stop-string request's text in a map of its own after the finish",
           "engine/output_processor.py",
           "        new_token_ids = primary.output_token_ids[req.num_reported_tokens:] if req.beam is None else []\n",
           "        if finished and isinstance(primary.stop_reason, str):  # after _completion decoded the text\n"
           "            self.__dict__.setdefault(\"holdback\", {})[req.request_id] = primary.output_text\n"
           "        new_token_ids = primary.output_token_ids[req.num_reported_tokens:] if req.beam is None else []\n"),
    Mutant("matcher-kept-on-abort", "structured output",
           "an aborted sequence's grammar matcher is never dropped", "engine/core/structured_output.py",
           "        if seq.seq_id in self.matchers:\n",
           "        if seq.finish_reason is not None and seq.finish_reason.value == \"abort\":\n            return\n"
           "        if seq.seq_id in self.matchers:\n"),
    Mutant("block-id-list-never-emptied", "host memory (vllm#44175)",
           "every allocated block id is appended to a list nobody empties", "engine/core/block_pool.py",
           "        block = self.blocks[self.free_block_queue.popleft()]\n",
           "        block = self.blocks[self.free_block_queue.popleft()]\n"
           "        self.__dict__.setdefault(\"new_block_ids\", []).append(block.block_id)\n"),
    # A leak that switched off the census that would report it (the two maps that gated
    # it), a second reference by the same holder (the ledger overwrote the first), a metric
    # labelled by a client value (litellm#12159)
    Mutant("live-map-keeps-finished", "serving loop (census gate)",
           "the engine loop keeps a finished request's entry in its live map (which gated its census)",
           "engine/serving/engine_loop.py", "                    del self._live[out.request_id]\n", "",
           mode="serve"),
    Mutant("open-group-kept-after-finish", "async client (census gate)",
           "the async client keeps a finished request's stream group (which gated the API server's census)",
           "engine/serving/async_engine.py",
           "                    if out.finished:\n                        self._groups.pop(out.request_id, None)\n", "",
           mode="serve"),
    Mutant("fork-second-reference-last-block", "fork (ledger)",
           "fork() takes a second reference on the child's last block (its table holds it once)",
           "engine/core/kv_cache_manager.py", "            self._record(block_id, child, AllocationSite.FORK, now)\n",
           "            self._record(block_id, child, AllocationSite.FORK, now)\n        if table:\n"
           "            self.blocks[table[-1]].ref_count += 1\n"
           "            self._record(table[-1], child, AllocationSite.FORK, now)\n"),
    Mutant("metric-labelled-by-request-id", "/metrics (label cardinality)",
           "a finished-request counter labelled by the client's X-Request-Id: one series per request",
           "entrypoints/metrics.py", "        if out.finished:\n            # One count per engine request",
           "        if out.finished:\n            if not hasattr(self, \"by_client\"):\n"
           "                self.by_client = Counter(\"vlite:request_finished_by_client\", \"Finished requests.\", "
           "[\"model_name\", \"client_request_id\"], registry=self.registry)\n"
           "            self.by_client.labels(self.model_name, out.request_id).inc()\n"
           "            # One count per engine request", mode="serve"),
    Mutant("buffer-per-finished-request", "host memory",
           "a 4 KiB buffer per finished request is kept in a list (no request id in it)",
           "engine/output_processor.py", "        primary = seqs[0]\n        finished = req.is_finished\n",
           "        primary = seqs[0]\n        finished = req.is_finished\n        if finished:\n"
           "            self.__dict__.setdefault(\"last_buffers\", []).append(bytearray(4096))\n"),
    # Workload variety: a memo keyed by content (found only when prompts do not repeat:
    # --prompt-source distinct, the default) and a bounded cache (llama.cpp#25740's host prompt
    # cache, with a size limit: must stay CLEAN, reported as a bounded cache with its entries)
    Mutant("word-memo-unbounded", "host memory (content-keyed)",
           "tokenization memoized per prompt word in a dict with no bound (a BPE word cache)",
           "engine/llm_engine.py", "            prompt_token_ids = self.tokenizer(prompt).input_ids\n",
           "            memo = self.__dict__.setdefault(\"word_ids\", {})\n"
           "            for word in prompt.split():\n"
           "                if word not in memo:\n"
           "                    memo[word] = self.tokenizer(word, add_special_tokens=False).input_ids\n"
           "            prompt_token_ids = self.tokenizer(prompt).input_ids\n"),
    Mutant("prompt-cache-bounded", "host memory (bounded cache: must stay CLEAN)",
           "prompt token ids cached by prompt text, least recently used evicted past 6,144 tokens (llama.cpp#25740)",
           "engine/llm_engine.py", "            prompt_token_ids = self.tokenizer(prompt).input_ids\n",
           "            import collections\n"
           "            cache = self.__dict__.setdefault(\"prompt_cache\", collections.OrderedDict())\n"
           "            prompt_token_ids = cache.get(prompt)\n"
           "            if prompt_token_ids is None:\n"
           "                prompt_token_ids = cache[prompt] = self.tokenizer(prompt).input_ids\n"
           "                self.prompt_cache_tokens = getattr(self, \"prompt_cache_tokens\", 0) + len(prompt_token_ids)\n"
           "                while self.prompt_cache_tokens > 6144:\n"
           "                    self.prompt_cache_tokens -= len(cache.popitem(last=False)[1])\n"
           "            else:\n"
           "                cache.move_to_end(prompt)\n", expect_clean=True),
    # Every API path: a multi-prompt completion with one prompt refused after the others
    # were admitted (sglang#28380, vllm#27420): the admitted prompts are not aborted, so they keep
    # their blocks and decode for a client that already had its error
    Mutant("multi-prompt-rejection-keeps-admitted", "multi-prompt rejection",
           "when one prompt of a multi-prompt request is refused, the prompts admitted before it are not aborted",
           "engine/llm_engine.py",
           "            for rid in added:\n                self.abort(rid)\n"
           "                self.rejection_counts[\"sibling rejected\"] += 1\n", ""),
    Mutant("samples-abort-prefill-drops-tables", "abort (n > 1, chunked prefill)",
           "aborting an n > 1 request during its chunked prefill drops the tables without a free",
           "engine/core/scheduler.py",
           "            self.kv_cache_manager.free(seq)\n            req = self.requests[seq.request_id]",
           "            if reason is FinishReason.ABORT and seq.in_prefill and seq.sampling_params.n > 1:\n"
           "                self.kv_cache_manager.block_tables.pop(seq.seq_id, None)\n            else:\n"
           "                self.kv_cache_manager.free(seq)\n            req = self.requests[seq.request_id]"),
    # Device memory held per request, which only the allocator's history names
    # (`leak-check --trace-gpu-allocations` on CUDA: benchmarks/gpu/gpu_alloc_site_check.py)
    Mutant("tensor-kept-per-request-on-device", "device memory (GPU allocation site)",
           "the model runner keeps a copy of every new prefill's hidden states on the device, in a list nobody empties",
           "engine/worker/model_runner.py",
           "        prompt_logprobs = compute_prompt_logprobs(self.model, hidden, step.prompt_logprobs)  # {} unless asked\n",
           "        end = 0\n        for q, s in zip(step.query_lens, step.seq_lens):\n            end += q\n"
           "            if q == s:  # a prefill from the prompt's first token\n"
           "                self.__dict__.setdefault(\"prefill_states\", []).append(hidden[end - q:end].clone())\n"
           "        prompt_logprobs = compute_prompt_logprobs(self.model, hidden, step.prompt_logprobs)  # {} unless asked\n"),
    # Per-request state inside a tensor-parallel worker process (the census and
    # host-memory check of the engine's process never look there); a native leak that only
    # one request kind takes (vllm#50150: per-process growth per request kind names it)
    Mutant("worker-prompt-progress-kept", "tensor-parallel worker (-tp 2)",
           "each rank keeps every sequence's prompt-logprobs progress in a map of its own, never cleared",
           "engine/worker/worker.py", "        logits, prompt_logprobs = self.runner.execute_model(step)\n",
           "        for rows in step.prompt_logprobs:\n"
           "            self.__dict__.setdefault(\"prompt_progress\", {})[rows.seq_id] = rows.first + len(rows.targets)\n"
           "        logits, prompt_logprobs = self.runner.execute_model(step)\n", args=("-tp", "2")),
    # (mmap, as a native host buffer such as pinned memory is allocated: a malloc'd one would first
    # reuse the heap pages that the logprobs path's large logits tensors freed, and show only later)
    Mutant("native-buffer-per-logprobs-request", "host memory per request kind (native)",
           "a 1 MiB native (mmap'd) buffer per finished logprobs sequence, never unmapped (no Python object holds it)",
           "engine/output_processor.py", "        finished = seq.is_finished\n",
           "        finished = seq.is_finished\n"
           "        if finished and seq.sampling_params.logprobs is not None:\n"
           "            import ctypes\n"
           "            libc = ctypes.CDLL(None)\n"
           "            libc.mmap.restype = ctypes.c_void_p\n"
           "            libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,"
           " ctypes.c_long]\n"
           "            ctypes.memset(libc.mmap(None, 1 << 20, 3, 0x22, -1, 0), 1, 1 << 20)\n",
           args=("--workload", "kind-waves")),
    Mutant("lru-cache-keyed-by-request", "per-request state (functools cache)",
           "an unbounded lru_cache on a method, called with each output's request id (its keys hold self and the id)",
           "engine/output_processor.py", "    def make_output(self, req: Request) -> RequestOutput:\n",
           "    @__import__(\"functools\").lru_cache(maxsize=None)  # noqa: B019\n"
           "    def _samples_summary(self, request_id: str, n: int) -> str:\n"
           "        return f\"{request_id}: {n}\"\n\n"
           "    def make_output(self, req: Request) -> RequestOutput:\n"
           "        self._samples_summary(req.request_id, len(req.seqs))\n"),
    Mutant("usage-kept-by-response-id", "per-request state (derived key)",
           "the API server keeps each answer's prompt count under the id handed to the client (chatcmpl-<id>, cmpl-<id>)",
           "entrypoints/serving.py", "        self.response_id = f\"{self.response_id_prefix}-{info.request_id}\"\n",
           "        self.response_id = f\"{self.response_id_prefix}-{info.request_id}\"\n"
           "        self.state.__dict__.setdefault(\"prompts_by_response_id\", {})[self.response_id] = len(prompts)\n",
           mode="serve"),
    # A window of the last 1000 finishes (as vLLM's prefix-cache hit-rate window): it grows one
    # entry per request through any run shorter than its cap, which its type declares
    Mutant("window-of-last-finishes", "host memory (bounded window: must stay CLEAN)",
           "the output processor keeps the sample count of the last 1000 finished requests in a class-level "
           "deque(maxlen=1000)",
           "engine/output_processor.py", "        finished = req.is_finished\n",
           "        finished = req.is_finished\n"
           "        if finished:\n"
           "            if \"_finished_window\" not in type(self).__dict__:\n"
           "                type(self)._finished_window = __import__(\"collections\").deque(maxlen=1000)\n"
           "            type(self)._finished_window.append(len(seqs))\n",
           expect_clean=True),
    # A client that leaves while its request is admitted (a slow tokenizer, a busy queue): the
    # handler's cancellation stops the wait, not the admission, and nothing aborts the requests
    Mutant("admission-ignores-client-cancel", "serving (admission)",
           "admission (render, then queue) takes 0.3 s and is shielded from the handler's cancellation: a client "
           "that leaves meanwhile leaves its requests queued, and the response that would abort them is never sent",
           "entrypoints/serving.py", '        prompts = await off_loop(self.state, self.render)\n        params = self.params(prompts)\n        if params.structured_outputs is not None:  # a bad schema / regex / grammar is a 400 now\n            await compile_constraint(self.state, self.req, params.structured_outputs)\n        info = RequestInfo.from_request(self.request)\n        group = await add_to_engine(self.state, [\n            EngineRequest(text, params, info.origin(info.engine_request_id(p, len(prompts))), ids)\n            for p, (text, ids) in enumerate(prompts)])\n',
           '        async def admit():\n            await asyncio.sleep(0.3)\n            prompts = await off_loop(self.state, self.render)\n            params = self.params(prompts)\n            if params.structured_outputs is not None:\n                await compile_constraint(self.state, self.req, params.structured_outputs)\n            info = RequestInfo.from_request(self.request)\n            group = await add_to_engine(self.state, [\n                EngineRequest(text, params, info.origin(info.engine_request_id(p, len(prompts))), ids)\n                for p, (text, ids) in enumerate(prompts)])\n            return prompts, info, group\n\n        prompts, info, group = await asyncio.shield(asyncio.ensure_future(admit()))\n',
           mode="serve", args=("--blackbox",)),
]


def build_model(workdir: Path) -> Path:
    """A tiny random Llama (tests/conftest.py) whose EOS id is a token it really generates."""
    out = workdir / "tiny-eos"
    if (out / "config.json").exists():
        return out
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import build_tiny_model_dir

    from vlite.diagnostics.workload.all_paths import CHAT_MESSAGES
    from vlite.engine.config import CacheConfig, EngineConfig
    from vlite.engine.llm_engine import LLMEngine
    from vlite.engine.sampling_params import SamplingParams

    build_tiny_model_dir(out)
    engine = LLMEngine(EngineConfig(model=str(out), device="cpu", cache=CacheConfig(num_blocks=64)))
    tok = engine.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": m}], tokenize=False, add_generation_prompt=True)
               for m in CHAT_MESSAGES]
    outs = engine.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    eos = sorted({o.outputs[0].token_ids[3] for o in outs})  # greedy's 4th token of each chat prompt
    cfg = json.loads((out / "config.json").read_text())
    cfg["eos_token_id"] = eos
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    gen = out / "generation_config.json"
    if gen.exists():
        g = json.loads(gen.read_text())
        g["eos_token_id"] = eos
        gen.write_text(json.dumps(g, indent=2))
    return out


_BOOT = ("import sys; sys.meta_path[:] = [f for f in sys.meta_path if not type(f).__module__.startswith('__editable__')];"
         " sys.path.insert(0, sys.argv.pop(1)); from vlite.cli.main import app; app(prog_name='vlite')")


def run_leak_check(tree: Path, args: list[str], timeout: int = 300) -> tuple[int, str, float]:
    # the tree's C++ sources link to this checkout's (copy_package): it loads this checkout's build
    env = os.environ | {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "COLUMNS": "200",
                        "TOKENIZERS_PARALLELISM": "false"}
    t0 = time.time()
    try:
        p = subprocess.run([sys.executable, "-c", _BOOT, str(tree), "leak-check", *args], capture_output=True,
                           text=True, timeout=timeout, env=env)
        return p.returncode, p.stdout + p.stderr, time.time() - t0
    except subprocess.TimeoutExpired as exc:
        return 124, f"timed out after {timeout} s: {exc.stdout or ''}", time.time() - t0


def blame(report: Path) -> str:
    """What the default command's report.json blamed, in a few words."""
    try:
        r = json.loads((report / "report.json").read_text())
    except (OSError, ValueError):
        return "no report"
    parts = []
    if r.get("by_action"):
        parts.append("actions " + ",".join(g["action_kind"] for g in r["by_action"][:3]))
    if r.get("by_site"):
        parts.append("sites " + ",".join(g["site"] for g in r["by_site"][:3]))
    if r.get("by_request"):
        parts.append(f"path: {r['by_request'][0].get('suspected_path')}")
    if r.get("anomalies"):
        parts.append(f"{len(r['anomalies'])} anomalies ({r['anomalies'][0]['kind']})")
    if r["drain"].get("sign", "balanced") != "balanced":  # a black-box report has no ledger drain
        parts.append(f"drain {r['drain']['sign']} {r['drain']['mismatch_blocks']:+d}")
    regs = r.get("registries") or {}
    if regs.get("leftover"):
        parts.append("registries " + ",".join(x["registry"] for x in regs["leftover"]))
    if regs.get("over_bound"):
        parts.append("history " + ",".join(x["history"] for x in regs["over_bound"]))
    if (r.get("cpu_state") or {}).get("leftover_requests"):
        parts.append(f"{len(r['cpu_state']['leftover_requests'])} request entries")
    if r.get("unattributed"):
        parts.append(f"{len(r['unattributed'])} unattributed")
    held = (r.get("census") or {}).get("held") or []
    if held:
        parts.append("census " + ",".join(f"{h['path']} {h['num_entries']}" for h in held[:3]))
    hm = r.get("host_memory") or {}
    if hm.get("verdict") == "HOST-LEAK":
        kinds = (hm.get("kind_growth") or {}).get("growing") or []
        parts.append("host " + ",".join([f"{g['path']} +{g['entries_per_request']}/request"
                                         + (f" ({g['probe']['kind']})" if g.get("probe") else "") for g in hm["growing"][:2]]
                                        + [f"{k['process']} +{k['bytes_per_request'] / 1024:.0f} KiB/{k['kind']} request"
                                           for k in kinds[:2]]))
    z = r.get("zombies") or {}
    if z.get("zombies"):
        first = z["zombies"][0]
        parts.append(f"{len(z['zombies'])} zombies (first {first.get('request_id')}: {first.get('client_action')})")
    if hm.get("bounded_caches"):
        parts.append("bounded caches " + ",".join(f"{b['path']} ({b['entries']} entries)" for b in hm["bounded_caches"]))
    return "; ".join(parts) or r.get("summary", "")


def serve_and_check(tree: Path, model: Path, out: Path, args: tuple[str, ...] = ()) -> dict:
    """`vlite serve` from ``tree`` (engine core in its own process, the default), then the default
    command's workload through `leak-check --url` (``args`` added: ``--blackbox`` checks it as any
    other server's, with the zombie check's early leavers); the server is stopped after."""
    import socket
    import urllib.request

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = os.environ | {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "TOKENIZERS_PARALLELISM": "false",
                        "PYTHONPATH": str(tree)}  # the engine core process imports the copy too
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "serve.log", "wb") as log:
        srv = subprocess.Popen([sys.executable, "-c", _BOOT, str(tree), "serve",
                                "--model", str(model), "--host", "127.0.0.1", "--port", str(port)],
                               stdout=log, stderr=subprocess.STDOUT, env=env)
        t0 = time.time()
        try:
            while time.time() - t0 < 600 and srv.poll() is None:  # a first start builds the C++ kernels
                try:
                    if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200:
                        break
                except OSError:
                    time.sleep(0.5)
            rep = out / "report"
            code, text, secs = run_leak_check(tree, ["--url", f"http://127.0.0.1:{port}", *DEFAULT_ARGS, *args,
                                                     "--report", str(rep)])
        finally:
            srv.terminate()
            try:
                srv.wait(timeout=30)
            except subprocess.TimeoutExpired:
                srv.kill()
    summary = next((line for line in text.splitlines() if line.startswith(("LEAK", "CLEAN", "ZOMBIE", "HOST"))), "")
    return {"default_exit": code, "default_caught": code == 1, "default_blame": (blame(rep) or summary)[:300]
            if code == 1 else text[-300:], "scenarios_exit": None, "scenarios_caught": False,
            "scenarios_failed": ["(--url: not run)"], "seconds": round(time.time() - t0, 1), "default_tail": ""}


def check(tree: Path, model: Path, out: Path, mode: str = "in-process", scenarios: bool = True,
          args: tuple[str, ...] = ()) -> dict:
    if mode == "serve":
        return serve_and_check(tree, model, out, args)
    rep = out / "report"
    code_d, text_d, t_d = run_leak_check(tree, ["--model", str(model), *DEFAULT_ARGS, *args, "--report", str(rep)])
    code_s, text_s, t_s = (run_leak_check(tree, ["--model", str(model), "--scenario", "all"], timeout=900)
                           if scenarios else (None, "", 0.0))
    failed = [line.split(":")[0] for line in text_s.splitlines() if ": FAIL" in line]
    return {"default_exit": code_d, "default_caught": code_d == 1, "default_blame": blame(rep) if code_d != 2 else
            text_d[-300:], "scenarios_exit": code_s, "scenarios_caught": code_s == 1, "scenarios_failed": failed,
            "seconds": round(t_d + t_s, 1), "default_tail": text_d[-400:] if code_d not in (0, 1) else ""}


def copy_package(tree: Path) -> None:
    """Copy vlite/ into ``tree`` (replacing what was there), its C++ kernel sources as links to
    this checkout's: the copy then loads the kernels already built for this checkout instead of
    building its own (2-3 minutes a copy on 2 cores). No mutant patches a C++ file."""
    shutil.rmtree(tree, ignore_errors=True)
    shutil.copytree(ROOT / "vlite", tree / "vlite", ignore=shutil.ignore_patterns("__pycache__"))
    for src in (ROOT / "vlite" / "kernels").iterdir():
        if src.suffix in (".cpp", ".h"):
            dest = tree / "vlite" / "kernels" / src.name
            dest.unlink()
            dest.symlink_to(src)


def main() -> int:
    """Exit code: 0 when every chosen defect was caught by the default command and the clean tree
    (and every bounded cache) stayed CLEAN; 1 otherwise."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "),
                                 epilog="See the module docstring (and docs/benchmarks.md, 'Mutation check') for "
                                        "how mutants are planted and counted.")
    ap.add_argument("--only", nargs="*", default=None, metavar="NAME",
                    help=f"Mutant names (default: all): {', '.join(m.name for m in MUTANTS)}.")
    ap.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "vlite-mutants"),
                    help="Where the tiny model and the patched package copies go (default: %(default)s).")
    ap.add_argument("--json", default=None, metavar="PATH", help="Also write the results as JSON here.")
    ap.add_argument("--skip-clean", action="store_true",
                    help="Skip the clean-tree run (which checks that both commands exit 0 on the unpatched code).")
    ap.add_argument("--skip-scenarios", action="store_true",
                    help="Run only the default command (not `--scenario all`, the slower half).")
    args = ap.parse_args()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    model = build_model(work)
    chosen = [m for m in MUTANTS if not args.only or m.name in args.only]
    rows = []
    if not args.skip_clean:
        tree = work / "clean"
        copy_package(tree)
        for mode, extra in sorted({(m.mode, m.args) for m in chosen}):  # "in-process" first
            label = " ".join([mode, *extra])
            res = check(tree, model, work / f"out-clean-{label.replace(' ', '_')}", mode, not args.skip_scenarios,
                        extra)
            rows.append({"mutant": "(clean tree)", "area": label, **res})
            scen = "scenarios not run" if args.skip_scenarios else f"scenarios exit {res['scenarios_exit']}"
            print(f"clean tree ({label}): default exit {res['default_exit']}, {scen} "
                  f"({res['seconds']} s){': ' + res['default_blame'] if res['default_exit'] else ''}", flush=True)
    for m in chosen:
        tree = work / "tree"
        copy_package(tree)
        src = tree / "vlite" / m.path
        text = src.read_text()
        if text.count(m.old) != 1:
            raise SystemExit(f"mutant {m.name}: the patched text occurs {text.count(m.old)} times in {m.path}")
        src.write_text(text.replace(m.old, m.new))
        out = work / f"out-{m.name}"
        shutil.rmtree(out, ignore_errors=True)
        res = check(tree, model, out, m.mode, not args.skip_scenarios, m.args)
        rows.append({"mutant": m.name, "area": m.path_area, "what": m.what, **res})
        if m.expect_clean:  # not a defect: the default command must stay CLEAN
            print(f"{m.name}: default {'CLEAN as it must be' if res['default_exit'] == 0 else 'FALSE POSITIVE'} "
                  f"(exit {res['default_exit']}; {res['default_blame']}) [{res['seconds']} s]", flush=True)
            continue
        scen = ("scenarios not run" if args.skip_scenarios else
                f"scenarios {'CAUGHT' if res['scenarios_caught'] else 'missed'} ({', '.join(res['scenarios_failed'])})")
        print(f"{m.name}: default {'CAUGHT' if res['default_caught'] else 'missed'} (exit {res['default_exit']}; "
              f"{res['default_blame']}), {scen} [{res['seconds']} s]", flush=True)
    clean_ones = {m.name for m in MUTANTS if m.expect_clean}
    muts = [r for r in rows if r["mutant"] != "(clean tree)" and r["mutant"] not in clean_ones]
    for r in rows:
        if r["mutant"] in clean_ones:
            print(f"{r['mutant']} (must stay CLEAN): {'CLEAN' if r['default_exit'] == 0 else 'FALSE POSITIVE'}")
    d = sum(r["default_caught"] for r in muts)
    s = sum(r["scenarios_caught"] for r in muts)
    either = sum(r["default_caught"] or r["scenarios_caught"] for r in muts)
    print(f"\n{len(muts)} mutants: default command caught {d}, " + ("--scenario all not run" if args.skip_scenarios else
          f"--scenario all caught {s}, either {either}"))
    print("\n| mutant | path | default command | `--scenario all` |\n|---|---|---|---|")
    for r in muts:
        print(f"| `{r['mutant']}` | {r['area']} | {'caught' if r['default_caught'] else 'missed'}: "
              f"{r['default_blame']} | {'not run' if args.skip_scenarios else 'caught' if r['scenarios_caught'] else 'missed'}"
              f"{': ' + ', '.join(r['scenarios_failed']) if r['scenarios_failed'] else ''} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    clean_ok = all(r["default_exit"] == 0 for r in rows if r["mutant"] == "(clean tree)" or r["mutant"] in clean_ones)
    return 0 if clean_ok and d == len(muts) else 1


if __name__ == "__main__":
    sys.exit(main())

"""A model family's container decoded, generated from and served (issue 39), Qwen3-MoE first, against transformers'
Qwen3MoeForCausalLM: runtime/decode.py's Decoder through the family protocol (with the expert cache, and with none),
step_batch, runtime/generate.py's Generator glue (the KV handed from the prefill, the memory estimate, the eos ids),
the chat template from the tokenizer_config (serve/chat_template.py) and the server's chat endpoint.

The prompt's KV comes from the family's own forward (families/qwen3_moe/model.py) wherever the prefill engine is not
the subject. The end-to-end tests at the bottom (`moepack generate`, `moepack serve`) run the layer-major prefill
engine on the family: until the engine prefills a family they skip, and only on its one-line refusal."""

from __future__ import annotations

import json
import time

import pytest
import torch
from click.testing import CliRunner

from moepack.cli.main import cli
from moepack.families import family_named
from moepack.families.qwen3_moe.model import KVState, forward
from moepack.format_spec.errors import MoepackError
from moepack.format_spec.reader import Container
from moepack.packer.convert import convert_checkpoint
from moepack.packer.synth import synth_checkpoint
from moepack.runtime.decode import Decoder
from moepack.runtime.engine import PrefillOptions, PrefillResult, StreamingPrefill
from moepack.runtime.generate import GenerateOptions, Generator
from moepack.runtime.memory import container_kv_bytes
from moepack.serve.app import make_app
from moepack.serve.chat_template import family_chat_template
from moepack.serve.tokenizer import PromptTokenizer

transformers = pytest.importorskip("transformers")
from test_qwen3_moe import CONFIGS, PROMPT, reference, save_model  # noqa: E402
from test_qwen3_moe_container import container_checkpoint  # noqa: E402
from test_serve import Running  # noqa: E402

FAMILY = family_named("qwen3-moe")
NEW_TOKENS = 8
OTHER_PROMPT = [9, 200, 31, 77, 5]
F32 = PrefillOptions(compute_dtype="float32")
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hi there"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(scope="module", params=["sparse-step", "mha-tied"])
def model(request, tmp_path_factory):
    """(container path, transformers' model) of a random float32 Qwen3-MoE (dense-MLP layers, a tied head, MHA)
    converted --keep."""
    base = tmp_path_factory.mktemp(f"family-decode-{request.param}")
    hf = save_model(base / "hf", CONFIGS[request.param], torch.float32)
    path = str(base / "m.moepack")
    convert_checkpoint(str(base / "hf"), path, policy="keep", progress=False)
    return path, hf.eval()


def needs_kernels() -> None:
    from moepack.backends import token_kernels

    if token_kernels.token_kernels() is None:
        pytest.skip("no C compiler (or MOEPACK_NATIVE=0): decode keeps torch")


@pytest.fixture(scope="module")
def fp8_release(tmp_path_factory) -> str:
    """A tiny Qwen3 `-FP8` release converted --keep (its experts FP8 as stored), where the token kernels are."""
    needs_kernels()
    base = tmp_path_factory.mktemp("fp8-release")
    synth_checkpoint(str(base / "src"), preset="tiny", layout="release", seed=3, progress=False, family="qwen3-moe")
    convert_checkpoint(str(base / "src"), str(base / "fp8.moepack"), policy="keep", progress=False)
    return str(base / "fp8.moepack")


def transformers_greedy(hf, prompt, new_tokens=NEW_TOKENS) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                          do_sample=False)
    return out[0, len(prompt):].tolist()


def prefilled(path, prompt):
    """(last logits, KV state) of `prompt` by the family's own forward over the container's weights."""
    loaded = container_checkpoint(path)
    kv = KVState.empty(loaded.config)
    return forward(loaded, prompt, kv)[-1], kv


def decoder(container, cache_bytes) -> Decoder:
    return Decoder(container, FAMILY.parse_config(container.config), torch.device("cpu"), cache_bytes,
                   family=FAMILY)


# ------------------------------------------------------------------------------------------ the Decoder


@pytest.mark.parametrize("cache_bytes", [1 << 30, 0], ids=["cache", "no-cache"])
def test_decoder_greedy_tokens_equal_transformers_generate(model, cache_bytes):
    path, hf = model
    logits, kv = prefilled(path, PROMPT)
    with Container(path) as c:
        d = decoder(c, cache_bytes)
        try:
            d.begin(kv.layers)  # what a prefill hands on: one state per layer
            out = []
            for _ in range(NEW_TOKENS):
                out.append(int(logits.argmax()))
                logits = d.step(out[-1])
            stats = d.stats_dict()
            assert d.current.seen_tokens == len(PROMPT) + NEW_TOKENS
        finally:
            d.close()
    assert out == transformers_greedy(hf, PROMPT)
    assert stats["tokens"] == NEW_TOKENS and stats["bytes_read"] > 0
    if cache_bytes:  # the experts read once are hits later: fewer bytes than a read per use
        assert stats["expert_cache_hit_rate"] > 0 and stats["cache_experts"] > 0
    else:
        assert stats["expert_cache_hit_rate"] == 0 and stats["cache_experts"] == 0 and stats["cache_bytes"] == 0


def test_fp8_experts_run_in_the_token_kernel_alone_and_batched(fp8_release, monkeypatch):
    """A Qwen3 `-FP8` release's experts (e4m3 under BF16 scales per 128 x 128 block) kept as stored: each decode
    step runs them in the compiled token kernel on a CPU, one call a layer, alone and for a batch's rows (each
    row's routed sum that of its sequence alone), with the logits of decode without the kernel (the experts
    decoded to float32, then torch's matmuls: sums in another order)."""
    from moepack.backends import token_kernels

    path = fp8_release
    with Container(path) as c:
        assert {t.dtype for r in c.layers[0].experts for t in r.tensors} == {"F8_E4M3", "BF16"}
    prompts, steps = [PROMPT, OTHER_PROMPT], 4

    def decode(batched: bool):
        with Container(path) as c:
            d = decoder(c, 1 << 30)
            try:
                kvs = [prefilled(path, p) for p in prompts]
                seqs = [d.start(kv.layers) for _, kv in kvs]
                tokens, rows = [int(logits.argmax()) for logits, _ in kvs], []
                for _ in range(steps):
                    if batched:
                        step = d.step_batch(seqs, tokens)
                    else:
                        step = torch.cat([d.step_batch([s], [t]) for s, t in zip(seqs, tokens)])
                    rows.append(step)
                    tokens = step.argmax(-1).tolist()
                return torch.stack(rows), d.stats.kernel_layers, len(d.blocks)
            finally:
                d.close()

    alone, calls, layers = decode(False)
    assert calls == steps * len(prompts) * layers
    batched, calls, _ = decode(True)
    assert calls == steps * layers and torch.allclose(batched, alone, rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(token_kernels, "token_kernels", lambda: None)
    torch_path, calls, _ = decode(False)
    assert calls == 0
    assert torch.allclose(alone, torch_path, rtol=1e-4, atol=1e-4 * float(torch_path.abs().max()))
    assert torch.equal(alone.argmax(-1), torch_path.argmax(-1))


@pytest.mark.parametrize("kernel_takes_them", [True, False])
def test_a_cpu_step_runs_torch_on_one_thread_beside_the_kernels_threads(fp8_release, monkeypatch, kernel_takes_them):
    """A CPU step of a family whose torch functions could run its experts: the family's attention on one torch
    thread, beside the token kernel's, which splits the routed experts over every thread (two pools on the same
    CPUs each wait for the other's descheduled threads: 2x slower on 2 CPUs); experts the kernel does not take (a
    kind it lacks, as Q2_K) run by the family's torch FFN, torch then on every thread."""
    from moepack.backends import token_kernels
    from moepack.families.qwen3_moe.decode import Qwen3MoeDecode

    from moepack.runtime import decode, expert_runner

    path = fp8_release
    if not kernel_takes_them:  # as for a kind the kernel lacks
        for module in (decode, expert_runner):
            monkeypatch.setattr(module, "kernel_layout", lambda region, names: None)
    seen = {"attend": set(), "kernel": set(), "torch experts": set()}

    def recording(name, fn, threads):
        def call(*args, **kwargs):
            seen[name].add(threads())
            return fn(*args, **kwargs)
        return call
    monkeypatch.setattr(Qwen3MoeDecode, "attend", recording("attend", Qwen3MoeDecode.attend, torch.get_num_threads))
    monkeypatch.setattr(Qwen3MoeDecode, "expert_ffn", staticmethod(recording(
        "torch experts", Qwen3MoeDecode.expert_ffn, torch.get_num_threads)))
    for name in ("moe", "moe_rows"):
        monkeypatch.setattr(token_kernels.TokenKernels, name, recording(
            "kernel", getattr(token_kernels.TokenKernels, name), token_kernels.current_threads))
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        logits, kv = prefilled(path, PROMPT)
        with Container(path) as c:
            d = decoder(c, 1 << 30)
            try:
                d.step_batch([d.start(kv.layers)], [int(logits.argmax())])
                after = torch.get_num_threads()
            finally:
                d.close()
    finally:
        torch.set_num_threads(threads)
    assert after == 3 and seen["attend"] == {1}
    if kernel_takes_them:
        assert seen["kernel"] == {3} and not seen["torch experts"]
    else:
        assert seen["torch experts"] == {3} and not seen["kernel"]


def test_a_cache_hit_reads_nothing_and_gives_the_same_logits(model):
    """The same tokens decoded twice over one Decoder: the second pass is all hits (nothing read), same logits."""
    path, _ = model
    with Container(path) as c:
        d = decoder(c, 1 << 30)
        try:
            runs = []
            for _ in range(2):
                _, kv = prefilled(path, PROMPT)
                d.begin(kv)  # the family's KV state itself
                before = d.stats.bytes_read
                runs.append(torch.stack([d.step(t) for t in (3, 14, 15)]))
                read = d.stats.bytes_read - before
            assert read == 0 and d.stats_dict()["expert_cache_hit_rate"] == 1.0
        finally:
            d.close()
    assert torch.equal(runs[0], runs[1])


def test_step_batch_of_two_sequences_equals_each_alone(model):
    path, _ = model
    prompts = [PROMPT, OTHER_PROMPT]
    with Container(path) as c:
        d = decoder(c, 0)
        try:
            alone = []
            for prompt in prompts:
                logits, kv = prefilled(path, prompt)
                seq, rows, token = d.start(kv.layers), [], int(logits.argmax())
                for _ in range(4):
                    rows.append(d.step_batch([seq], [token])[0])
                    token = int(rows[-1].argmax())
                alone.append(torch.stack(rows))
            starts = [prefilled(path, p) for p in prompts]
            sequences = [d.start(kv) for _, kv in starts]
            tokens, together = [int(logits.argmax()) for logits, _ in starts], []
            for _ in range(4):
                step = d.step_batch(sequences, tokens)
                together.append(step)
                tokens = step.argmax(dim=-1).tolist()
        finally:
            d.close()
    together = torch.stack(together, dim=1)  # [sequence, step, vocab]
    for b in range(2):
        torch.testing.assert_close(together[b], alone[b], atol=1e-5, rtol=1e-5)
        assert together[b].argmax(-1).tolist() == alone[b].argmax(-1).tolist()


def test_on_a_cpu_a_step_of_six_sequences_gives_each_its_logits_alone_to_the_bit(model):
    """More rows than ops' SMALL_ROWS: the step's matmuls still take the token kernel for every row (each row's
    products and sums those of its sequence alone), the attention row by row, the experts in moe_rows: each
    sequence's logits those of its steps alone, to the bit (torch's GEMM over 6 rows sums in another order)."""
    needs_kernels()
    path, _ = model
    prompts = [PROMPT, OTHER_PROMPT, PROMPT[:5], OTHER_PROMPT[:3], [7, 8], PROMPT[2:]]
    with Container(path) as c:
        d = decoder(c, 1 << 30)
        try:
            starts = [prefilled(path, p) for p in prompts]
            together = d.step_batch([d.start(kv) for _, kv in starts], [int(logits.argmax()) for logits, _ in starts])
            for row, (logits, kv) in enumerate(prefilled(path, p) for p in prompts):
                assert torch.equal(d.step_batch([d.start(kv)], [int(logits.argmax())])[0], together[row])
        finally:
            d.close()


def test_decoder_refuses_states_after_different_tokens(model):
    path, _ = model
    _, kv = prefilled(path, PROMPT)
    _, short = prefilled(path, PROMPT[:3])
    kv.layers[1] = short.layers[1]
    with Container(path) as c:
        d = decoder(c, 0)
        try:
            with pytest.raises(MoepackError, match="one KV state per layer, all after the same tokens"):
                d.start(kv.layers)
            with pytest.raises(MoepackError, match="one KV state per layer"):
                d.start(kv.layers[:-1])
        finally:
            d.close()


def test_the_family_decode_names_no_expert_matrix():
    """An expert's matrices come from the family's expert_naming: decode (one path for every family since
    LayerDecode) and its device pool hold no DeepSeek-V4 expert names."""
    import inspect

    from moepack.runtime import decode, device_decode

    for module in (decode, device_decode):
        source = inspect.getsource(module)
        assert not any(f'"{m}' in source or f"'{m}" in source or f".{m}." in source for m in ("w1", "w2", "w3"))
    assert "expert_naming" in inspect.getsource(decode.Decoder._kernel_layout)
    assert "naming.names(" in inspect.getsource(device_decode.container_pool)


# ------------------------------------------------------------------------------------------ the Generator glue


class FamilyForwardPrefill:
    """Stands in for StreamingPrefill (until it prefills a family) with the family's forward over the container:
    what the Generator needs of it, run(ids, keep_kv=True) -> PrefillResult whose states are the family's KV
    state's layers (one per layer, each with seen_tokens)."""

    device = torch.device("cpu")

    def __init__(self, path):
        self.checkpoint = container_checkpoint(path)
        self.runs = 0

    def run(self, token_ids, past=None, keep_kv=False, should_stop=None, **_):
        self.runs += 1
        kv = KVState.empty(self.checkpoint.config)
        if past:  # a prefill hands on the layers' states
            kv.layers[:] = list(past)
        logits = forward(self.checkpoint, token_ids, kv)[-1]
        return PrefillResult(logits, int(logits.argmax()), {"tokens": len(token_ids), "seconds": 0.0}, [],
                             kv.layers if keep_kv else None, None)

    def run_many(self, prompts, pasts=None, keep_kv=True, should_stop=None, **_):
        return [self.run(ids, past, keep_kv) for ids, past in zip(prompts, pasts or [None] * len(prompts))]

    def check_memory(self, n_tokens, scored_tokens=0, freeable_bytes=0):
        pass

    def after_prompt(self):  # (a Generator keeps its engine open between prompts)
        pass

    def close(self):
        pass


def test_generator_hands_the_prefills_family_kv_to_the_decode(model, monkeypatch):
    path, hf = model
    stand_in = FamilyForwardPrefill(path)
    for cache_gib in (1.0, 0.0):
        with Generator(path, cache_gib=cache_gib, prefill=F32) as g:
            assert g.family is FAMILY and g.decoder.family is FAMILY
            monkeypatch.setattr(g, "prefill_engine", lambda: stand_in)
            result = g.generate(PROMPT, GenerateOptions(max_new_tokens=NEW_TOKENS, stop_at_eos=False))
        assert result.generated_ids == transformers_greedy(hf, PROMPT), cache_gib
        assert result.finish_reason == "length" and result.stats["decode"]["tokens"] == NEW_TOKENS - 1
    assert stand_in.runs == 2


def test_the_batch_scheduler_decodes_family_sequences_together(model, monkeypatch):
    """runtime/batching.py over a family's Generator: prompts prefilled in chunks (each continuing its KV state),
    then decoded together by step_batch, each giving transformers' greedy tokens."""
    from moepack.runtime.batching import BatchScheduler

    path, hf = model
    prompts = [PROMPT, OTHER_PROMPT, PROMPT[:4]]
    with Generator(path, cache_gib=0.5, prefill=F32) as g:
        monkeypatch.setattr(g, "prefill_engine", lambda: FamilyForwardPrefill(path))
        with BatchScheduler(g, max_batch=4, prefill_chunk=4) as scheduler:
            futures = [scheduler.submit(p, GenerateOptions(max_new_tokens=6, stop_at_eos=False)) for p in prompts]
            results = [f.result(timeout=120) for f in futures]
    for prompt, result in zip(prompts, results):
        assert result.generated_ids == transformers_greedy(hf, prompt, 6)


def test_generator_memory_estimate_is_the_familys_kv(model):
    path, _ = model
    with Container(path) as c:
        cfg = FAMILY.parse_config(c.config)
        per_layer = 2 * 1000 * cfg.num_kv_heads * cfg.head_dim * 4  # keys and values, float32
        assert container_kv_bytes(c, 1000) == cfg.num_layers * per_layer


def test_generator_refuses_a_kv_dtype_it_does_not_know_for_a_family(model, tmp_path):
    """(a family's KV directories themselves: tests/test_family_kv.py)"""
    path, _ = model
    with Generator(path, cache_gib=0, prefill=F32) as g:
        with pytest.raises(MoepackError, match=r"^unknown KV dtype 'F16' \(choose one of F32, BF16, F8_E4M3\)$"):
            g.generate(PROMPT, GenerateOptions(max_new_tokens=2), kv_out=str(tmp_path / "kv"), kv_dtype="F16")
    assert not (tmp_path / "kv").exists()


# ------------------------------------------------------------------------------------------ chat template, eos


@pytest.fixture(scope="module")
def synthesized(tmp_path_factory):
    """`synth --family qwen3-moe` (float32, with Qwen's tokenizer files and ChatML template, generation_config)
    and its container converted --keep: (directory, container path)."""
    base = tmp_path_factory.mktemp("family-synth")
    synth_checkpoint(str(base / "src"), preset="tiny", layout="f32", seed=4, progress=False, family="qwen3-moe")
    path = str(base / "s.moepack")
    convert_checkpoint(str(base / "src"), path, policy="keep", progress=False)
    return base / "src", path


def test_the_chat_template_renders_transformers_prompt_ids(synthesized):
    directory, path = synthesized
    theirs = transformers.AutoTokenizer.from_pretrained(directory)
    with Container(path) as c:
        template, tok = family_chat_template(c, FAMILY), PromptTokenizer(c)
    for messages in (MESSAGES, MESSAGES[1:2]):
        want = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
        assert tok.encode_special(template.render(messages)) == list(want)


def test_a_chat_template_that_fails_is_one_line():
    from moepack.serve.chat_template import ChatTemplate

    with pytest.raises(MoepackError, match="chat template refused the messages: no system role"):
        ChatTemplate("{{ raise_exception('no system role') }}", {}).render(MESSAGES)
    with pytest.raises(MoepackError, match="chat template does not compile"):
        ChatTemplate("{% for %}", {})
    bos = ChatTemplate("{{ bos_token }}{{ messages[0].content }}", {"bos_token": {"content": "<s>"}})
    assert bos.render(MESSAGES) == "<s>You are terse."



def test_a_filters_wide_spec_check_is_linear_in_a_messages_text():
    """A template's filter on a message's text (`content | trim`) checks it for a printf or format() width before
    the call (_WIDE_SPEC): a text of a brace and then colons (a client's 4 MB) had made its regex backtrack in time
    quadratic in it, the GIL held, past any render clock (40,000 characters ~10 s; a timing bound, generous: here
    milliseconds); a width is still refused."""
    from moepack.serve.chat_template import ChatTemplate

    template = ChatTemplate("{% for m in messages %}{{ m.content | trim }}{% endfor %}", {})
    started = time.monotonic()
    text = "{" + ":" * 40_000
    assert template.render([{"role": "user", "content": text}]) == text and time.monotonic() - started < 1.0
    with pytest.raises(MoepackError, match="a filter asked for more than"):
        template.render([{"role": "user", "content": "{0:" + ":" * 1000 + "1" * 9 + "}"}])

@pytest.mark.parametrize("template, words", [
    ("{{ 7**(7**9) }}", "** builds an integer of more than 4096 bits"),  # jinja had folded it while compiling
    ("{{ 'A' * 50000000 }}", "* builds more than 16,777,216 items"),
    ("{% set ns = namespace(x=3) %}{% for i in range(27) %}{% set ns.x = ns.x * ns.x %}{% endfor %}",
     "* builds an integer of more than 4096 bits"),  # (in C, holding the GIL: no clock could stop it)
    ("{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
     "~ builds more than 16,777,216 items"),
    ("{% set ns = namespace(s=['x']) %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
     "+ builds more than 16,777,216 items"),
    ("{% set x = 'a'|center(n) %}", "a filter asked for more than 16,777,216 items"),
    ("{% set x = '%0200000000d'|format(1) %}", "a filter asked for more than"),
    ("{% set x = '{:>999999999}'.format(1) %}", "a format asked for more than"),
    ("{% set x = 'ab'.replace('a', 'a' * 1000000).replace('a', 'a' * 100) %}", "a call builds more than"),
    ("{% for i in range(70) %}{{ 'x' * 1000000 }}{% endfor %}", "its text ran past 67,108,864 characters"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "it ran past 0.5 s"),
    ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "RecursionError"),
    ("{{ 1 / 0 }}", "ZeroDivisionError"), ("{{ 10.0 ** 400 }}", "OverflowError"),
])
def test_a_chat_template_past_its_bounds_or_failing_is_one_line(monkeypatch, template, words):
    """The checkpoint's template is code run on every chat request: bounded in time, in text and in what one
    operator builds, and any failure of it one line (a server thread never hangs on it, nor fills the memory)."""
    from moepack.serve import chat_template

    monkeypatch.setattr(chat_template, "RENDER_SECONDS", 0.5)
    started = time.monotonic()
    with pytest.raises(MoepackError) as e:
        chat_template.ChatTemplate(template, {}).render(MESSAGES, n=10**9)
    assert words in str(e.value) and "\n" not in str(e.value) and time.monotonic() - started < 10


def test_tokenizer_config_chat_template_forms_as_transformers_reads_them():
    """A Jinja text; transformers' named forms (a list of {name, template}, a {name: template} object) by their
    'default'; anything else named for what it is, not read as a model without a template."""
    from moepack.families.base import chat_template_from_tokenizer_config as template_of

    assert template_of({}) is None and template_of({"chat_template": "T"}) == "T"
    named = [{"name": "tool_use", "template": "U"}, {"name": "default", "template": "T"}]
    assert template_of({"chat_template": named}) == template_of({"chat_template": {"default": "T"}}) == "T"
    for bad, words in (([{"name": "tool_use", "template": "U"}], "named templates without a 'default' one"),
                       (42, "expected a Jinja text or named templates, got int")):
        with pytest.raises(MoepackError, match=f"tokenizer_config.json chat_template: {words}"):
            template_of({"chat_template": bad})


def test_a_chat_template_jinja_file_takes_priority_over_tokenizer_config_as_in_transformers():
    """transformers reads chat_template.jinja before tokenizer_config.json's chat_template (which may then be of
    no form it reads at all); with neither, the error names both."""
    from moepack.serve.chat_template import NoChatTemplateError, family_chat_template

    class Files:
        def __init__(self, config, jinja):
            self.config, self.jinja = config, jinja

        def tokenizer_json(self, name):
            return self.config

        def tokenizer_text(self, name):
            return self.jinja

    for config in ({"chat_template": "config's"}, {"chat_template": 42}, {}):
        assert family_chat_template(Files(config, "file's"), FAMILY).render(MESSAGES) == "file's"
    assert family_chat_template(Files({"chat_template": "config's"}, None), FAMILY).render(MESSAGES) == "config's"
    with pytest.raises(NoChatTemplateError, match="neither tokenizer_config.json chat_template nor"):
        family_chat_template(Files({}, None), FAMILY)


def test_moepack_chat_talks_through_the_chat_template(synthesized):
    """`moepack chat` on a family that chats through its chat template: each turn encoded as `generate --chat`
    encodes it (the same greedy reply), the second turn after the first's reply."""
    _, path = synthesized
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "moepack", "chat", path, "-n", "5", "--json"], input="hi\nmore\n/exit\n",
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    replies = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(replies) == 2 and all(reply["ok"] for reply in replies)
    alone = CliRunner().invoke(cli, ["generate", path, "--chat", "hi", "-n", "5", "--json"])
    assert alone.exit_code == 0, alone.output
    assert json.loads(alone.stdout)["generated_ids"] == replies[0]["generated_ids"]


def test_generate_chat_refuses_a_reasoning_effort_for_a_chat_template(synthesized):
    _, path = synthesized
    r = CliRunner().invoke(cli, ["generate", path, "--chat", "hi", "--thinking", "--reasoning-effort", "high"])
    assert r.exit_code == 1 and len(r.output.strip().splitlines()) == 1
    assert "reasoning_effort: a qwen3-moe model's chat template takes no reasoning effort" in r.output


def test_the_eos_ids_come_from_the_config_and_generation_config(synthesized):
    directory, path = synthesized
    config = json.loads((directory / "config.json").read_text())
    generation = json.loads((directory / "generation_config.json").read_text())
    want = set()
    for source in (config, generation):
        eos = source.get("eos_token_id")
        want |= set(eos) if isinstance(eos, list) else {eos} if isinstance(eos, int) else set()
    with Generator(path, cache_gib=0, prefill=F32) as g:
        assert g.eos_ids == want and want


def test_a_family_container_without_a_chat_template_is_a_400_and_completions_work(model, monkeypatch):
    """No tokenizer files (save_pretrained of the model alone): chat completions is a 400 naming the missing chat
    template, a completion from token ids still runs (through the family-forward stand-in for the prefill)."""
    import httpx

    path, hf = model
    g = Generator(path, cache_gib=0.5, prefill=F32)
    monkeypatch.setattr(g, "prefill_engine", lambda: FamilyForwardPrefill(path))
    running = Running(make_app(g, "q", log=lambda line: None))
    try:
        r = httpx.post(f"{running.url}/v1/chat/completions", timeout=60,
                       json={"model": "q", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and "no chat template" in r.json()["error"]["message"]
        assert r.json()["error"]["param"] == "messages"
        out = running.client().completions.create(model="q", prompt=PROMPT, max_tokens=4, temperature=0)
        assert out.choices[0].model_dump()["token_ids"] == transformers_greedy(hf, PROMPT, 4)
    finally:
        running.stop()
        g.close()


# ------------------------------------------------------------------------------------------ end to end (the engine)

ENGINE_REFUSAL = "this runtime prefills DeepSeek-V4"


def needs_family_prefill(path):
    """Skip while the layer-major prefill engine refuses a family's container with its one-line refusal (until
    h-famprefill's engine is merged); any other failure fails the test."""
    with Container(path) as c:
        try:
            StreamingPrefill(c, F32)
        except MoepackError as e:
            if ENGINE_REFUSAL in str(e) and "\n" not in str(e):
                pytest.skip(f"the prefill engine does not run a family yet: {e}")
            raise


@pytest.mark.parametrize("cache_gib", ["1", "0"], ids=["cache", "no-cache"])
def test_moepack_generate_greedy_tokens_equal_transformers(synthesized, cache_gib):
    directory, path = synthesized
    needs_family_prefill(path)
    hf = reference(directory)
    tok = transformers.AutoTokenizer.from_pretrained(directory)
    prompt = "The quick brown fox"
    r = CliRunner().invoke(cli, ["generate", path, "--prompt", prompt, "--max-new-tokens", str(NEW_TOKENS),
                                 "--temperature", "0", "--cache-gib", cache_gib, "--compute-dtype", "float32",
                                 "--json"])
    assert r.exit_code == 0, r.output
    got = json.loads(r.output)
    ids = tok(prompt)["input_ids"]
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(ids):].tolist()
    assert got["generated_ids"] == want[:len(got["generated_ids"])] and got["generated_ids"]
    assert len(got["generated_ids"]) == NEW_TOKENS or got["finish_reason"] == "stop"


@pytest.mark.parametrize("max_batch", [1, 4], ids=["one-by-one", "batched"])
def test_moepack_serve_chat_completion_through_the_openai_client(synthesized, max_batch):
    directory, path = synthesized
    needs_family_prefill(path)
    hf, tok = reference(directory), transformers.AutoTokenizer.from_pretrained(directory)
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False)[0, len(ids):].tolist()
    g = Generator(path, cache_gib=0.5, prefill=F32)
    running = Running(make_app(g, "q", log=lambda line: None, max_batch=max_batch))
    try:
        out = running.client().chat.completions.create(model="q", messages=MESSAGES, max_tokens=6, temperature=0)
        assert out.usage.prompt_tokens == len(ids)
        eos = [t for t in want if t in g.eos_ids]
        text = tok.decode(want[:want.index(eos[0])] if eos else want)
        assert out.choices[0].message.content == text
    finally:
        running.stop()
        g.close()


def test_decode_names_no_family_and_both_families_give_its_protocol():
    """runtime/decode.py and device_decode.py name no family and none of DeepSeek-V4's tensors (the Decoder takes
    its arithmetic from the family's layer_decode, for every family); each family's LayerDecode has every method of
    the protocol."""
    import inspect

    from moepack.families.base import LayerDecode
    from moepack.families.deepseek_v4.decode import DeepseekV4Decode
    from moepack.families.qwen3_moe.decode import Qwen3MoeDecode
    from moepack.runtime import decode, device_decode, generate

    for module in (decode, device_decode):
        source = inspect.getsource(module)
        assert "deepseek" not in source.lower() and "qwen" not in source.lower(), module.__name__
        for name in ("tid2eid", "hc_", "wq_b", "cfg.head_weight", "hash_layers", "swiglu",
                     "embed.weight", "HEAD_GLOBALS", "TokenLayers", "model."):
            assert name not in source, (module.__name__, name)
    methods = [n for n, v in vars(LayerDecode).items() if callable(v) and not n.startswith("_")]
    assert {"attend", "route_attended", "finish", "head", "token_state", "token_layers"} <= set(methods)
    optional = {"token_head", "token_head_rows"}  # called only on the path token_layers gives
    assert all(callable(getattr(DeepseekV4Decode, n, None)) for n in methods)
    assert all(callable(getattr(Qwen3MoeDecode, n, None)) for n in set(methods) - optional)
    assert Qwen3MoeDecode.token_layers(None, []) is None  # no compiled path: the torch one
    for module in (decode, generate):  # the family's arithmetic for every container, none by default
        assert "default_layer_decode" not in inspect.getsource(module) and "generic_forward" not in \
            inspect.getsource(module), module.__name__

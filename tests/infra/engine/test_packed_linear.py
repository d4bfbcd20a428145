"""oneDNN-packed linears (infra.engine.packed_linear): the same fp32 results as the plain
model, the parameters untouched, and the engine serving through them, also after a reload."""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from infra.engine.engine import Engine
from infra.engine.packed_linear import available, pack_linears, unpack_linears
from infra.engine.tiny_model import ARCHS, make_tiny_model
from tests.models import save_beside_tokenizer

pytestmark = pytest.mark.skipif(not available(), reason="torch built without oneDNN")


@pytest.fixture(scope="module", params=ARCHS)
def model_dir(request, tmp_path_factory):
    """The tiny model of each family made 4x wider (256; k/v 128): wide enough to be packed
    (`MIN_FEATURES`), random weights, the tiny tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    src = make_tiny_model(tmp_path_factory.mktemp("packed") / "src", seed=0, arch=request.param)
    cfg = AutoConfig.from_pretrained(src)
    cfg.hidden_size, cfg.intermediate_size = 256, 512
    if getattr(cfg, "head_dim", None):
        cfg.head_dim = 64
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    out = tmp_path_factory.mktemp("packed") / "wide"
    return save_beside_tokenizer(model, src, out)


def test_narrow_layers_stay_plain(tmp_path):
    from transformers import AutoModelForCausalLM

    tiny = AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path / "t", seed=0))
    assert pack_linears(tiny) == 0  # 64 wide: oneDNN's call cost would not pay
    assert pack_linears(tiny, min_features=1) == _linears(tiny)


def _linears(model) -> int:
    return sum(isinstance(m, torch.nn.Linear) for m in model.modules())


def test_packed_model_computes_what_the_plain_one_does(model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([[(7 * i) % 500 + 5 for i in range(40)]] * 3)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.inference_mode():
        plain = model(ids).logits
        assert pack_linears(model) == _linears(model) > 0
        assert pack_linears(model) == 0  # packing twice packs nothing more
        packed = model(ids).logits
        # the same fp32 arithmetic in another summation order: through the layers the
        # reordering passes 1e-5 of the largest logit on some CPUs (CI: over 1.37e-4 of 13.7),
        # a wrong weight, bias or packing order is of the logits' own size
        diff = (packed - plain).abs()
        assert diff.max() <= 1e-3 * plain.abs().max()
        assert diff.mean() <= 1e-5 * plain.abs().mean()
        # parameters, tied embeddings and the state dict are the model's own, unchanged
        if model.config.tie_word_embeddings:
            assert model.lm_head.weight is model.model.embed_tokens.weight
        after = model.state_dict()
        assert after.keys() == state.keys()
        assert all(torch.equal(after[k], v) for k, v in state.items())
        assert unpack_linears(model) == _linears(model)
        assert torch.equal(model(ids).logits, plain)


def _kernels(eng: Engine) -> dict[str, int]:
    """Op name -> calls in one decode-shaped forward on the engine's scheduler thread."""

    def run():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            eng._forward(torch.tensor([[5], [6]]), torch.tensor([[0], [0]]), None)
        return {e.key: e.count for e in prof.key_averages()}

    return eng._run_command(run)


def test_engine_serves_packed_weights_also_after_a_reload(model_dir):
    eng = Engine(model_dir)
    plain = Engine(model_dir, pack_weights=False)
    try:
        n = _linears(eng.model)
        assert _kernels(eng).get("mkldnn::_linear_pointwise") == n
        assert "mkldnn::_linear_pointwise" not in _kernels(plain)
        # batched prefill and decode over packed weights vs a plain full forward (fp32)
        prompts = [[(s + 7 * i) % 1000 + 5 for i in range(24 + s)] for s in range(4)]
        sp = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
        eng.pause_generation("in_place")
        reqs = [eng.submit(p, sp) for p in prompts]
        eng.continue_generation()
        ref = plain.model
        for p, r in zip(prompts, reqs, strict=True):
            assert r.done.wait(60)
            with torch.inference_mode():
                lp = torch.log_softmax(ref(torch.tensor([p + r.output_ids])).logits[0], -1)
            want = [lp[len(p) - 1 + i, t].item() for i, t in enumerate(r.output_ids)]
            assert max(abs(a - b) for a, b in zip(r.output_logprobs, want, strict=True)) <= 1e-4
        assert eng.update_weights_from_disk(model_dir)["success"]
        assert _kernels(eng).get("mkldnn::_linear_pointwise") == n  # the new model is packed
        assert eng.weights_digest() == plain.weights_digest()  # of the parameters, unchanged
    finally:
        eng.close()
        plain.close()

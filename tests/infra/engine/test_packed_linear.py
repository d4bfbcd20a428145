"""oneDNN-packed linears (infra.engine.packed_linear): the same fp32 results as the plain
model, the parameters untouched, and the engine serving through them, also after a reload."""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from infra.engine.engine import Engine
from infra.engine.packed_linear import available, pack_linears, unpack_linears
from infra.engine.tiny_model import make_tiny_model

pytestmark = pytest.mark.skipif(not available(), reason="torch built without oneDNN")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("packed") / "llama", seed=0, arch="llama")


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
        # the same fp32 arithmetic in another summation order
        assert (packed - plain).abs().max() <= 1e-5 * plain.abs().max()
        # parameters, tied embeddings and the state dict are the model's own, unchanged
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
        prompt = [(3 + 7 * i) % 1000 + 5 for i in range(30)]
        sp = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
        a, b = eng.generate(prompt, sp), plain.generate(prompt, sp)
        assert a["output_ids"] == b["output_ids"]
        lps = [[x[0] for x in r["meta_info"]["output_token_logprobs"]] for r in (a, b)]
        assert max(abs(x - y) for x, y in zip(*lps, strict=True)) <= 1e-5
        assert eng.update_weights_from_disk(model_dir)["success"]
        assert _kernels(eng).get("mkldnn::_linear_pointwise") == n  # the new model is packed
        assert eng.weights_digest() == plain.weights_digest()  # of the parameters, unchanged
    finally:
        eng.close()
        plain.close()

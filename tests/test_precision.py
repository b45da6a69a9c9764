import jax.numpy as jnp
import jmp
import pytest

from jaxamp import get_policy
from jaxamp.precision import needs_loss_scaling, policy_name


@pytest.mark.parametrize("name,compute", [("fp32", jnp.float32), ("bf16", jnp.bfloat16), ("fp16", jnp.float16)])
def test_presets(name, compute):
    policy = get_policy(name)
    assert policy.param_dtype == jnp.float32
    assert policy.compute_dtype == compute
    assert policy.output_dtype == jnp.float32
    assert policy_name(policy) == name
    assert get_policy(name.upper()) == policy


def test_jmp_strings():
    p = get_policy("params=float32,compute=float16,output=float32")
    assert (p.param_dtype, p.compute_dtype, p.output_dtype) == (jnp.float32, jnp.float16, jnp.float32)
    assert policy_name(p) == "fp16"
    p = get_policy("p=f32,c=bf16")
    assert (p.param_dtype, p.compute_dtype, p.output_dtype) == (jnp.float32, jnp.bfloat16, jnp.bfloat16)
    assert get_policy("float16").param_dtype == jnp.float16


def test_policy_passthrough():
    p = jmp.Policy(jnp.float32, jnp.float16, jnp.float16)
    assert get_policy(p) is p


@pytest.mark.parametrize("bad", ["fp7", "params=float32,compute=float17", "colour=f16", ""])
def test_unknown_policy_lists_accepted(bad):
    with pytest.raises(ValueError) as err:
        get_policy(bad)
    msg = str(err.value)
    assert repr(bad) in msg and '"fp32"' in msg and '"fp16"' in msg and '"bf16"' in msg
    assert "p=f32,c=bf16" in msg or "(did you mean 'fp8'?)" in msg  # a near miss: the short message


def test_cast_to_compute_casts_only_floats():
    tree = {"w": jnp.ones((2,), jnp.float32), "i": jnp.ones((2,), jnp.int32)}
    out = get_policy("fp16").cast_to_compute(tree)
    assert out["w"].dtype == jnp.float16 and out["i"].dtype == jnp.int32


def test_needs_loss_scaling():
    assert needs_loss_scaling(get_policy("fp16"))
    assert not needs_loss_scaling(get_policy("bf16"))
    assert not needs_loss_scaling(get_policy("fp32"))


def test_auto_resolves_to_fp32_on_cpu():
    from jaxamp.precision import auto_precision

    name, reason = auto_precision()
    assert name == "fp32" and "cpu" in reason
    assert get_policy("auto") == get_policy("fp32")


def test_auto_precision_on_accelerators():
    from types import SimpleNamespace

    from jaxamp.precision import auto_precision

    h100 = SimpleNamespace(platform="gpu", device_kind="NVIDIA H100", compute_capability="9.0")
    v100 = SimpleNamespace(platform="gpu", device_kind="Tesla V100", compute_capability="7.0")
    tpu = SimpleNamespace(platform="tpu", device_kind="TPU v5e")
    assert auto_precision(h100)[0] == "bf16" and auto_precision(tpu)[0] == "bf16"
    assert auto_precision(v100)[0] == "fp16"
    gpu = lambda cc, kind="GPU": SimpleNamespace(platform="gpu", device_kind=kind, compute_capability=cc)
    assert [auto_precision(gpu(cc))[0] for cc in ("12.0", "8.6", "7.5", "6.0", "6.1", "5.2")] == [
        "bf16", "bf16", "fp16", "fp16", "fp32", "fp32"]  # 6.1 (GTX 10x0): float16 at 1/64 rate
    name, reason = auto_precision(SimpleNamespace(platform="gpu", device_kind="AMD MI300X"))  # no capability
    assert name == "fp32" and "unknown" in reason and "--precision" in reason


def test_a_near_miss_policy_name_is_refused_with_a_suggestion_and_the_fp8_recipes_listed():
    with pytest.raises(ValueError) as err:
        get_policy("fp8-curent")
    message = str(err.value)
    assert message.startswith("unknown precision policy 'fp8-curent' (did you mean 'fp8-current'?); the presets ")
    assert len(message) < 300  # short: the suggestion first
    assert 'the stateless FP8 recipes "fp8-current", "fp8-current-pow2", "fp8-block", "mxfp8"' in message
    with pytest.raises(ValueError, match=r"^unknown precision policy 'zzz'; accepted"):  # nothing close: no guess
        get_policy("zzz")

"""GroupQueryAttention (gradient_rules/contrib_attention.py): packed and separate q/k/v, rotary by halves and
interleaved, partial rotary, GQA head groups and plain multi-head, causal and bidirectional, padded batches
(seqlens_k below S - 1), a custom scale, gradients arriving at the present key/value outputs, softcap and a local
window (Gemma2 / Gemma3).

onnxruntime has float32 kernels only: each case checks the standard-ONNX form of contrib_forms.py against
the kernel (forward_rtol 1e-5 / atol 1e-6: float32 rounding of a softmax over a few keys and sums of 16-32
products), then gradchecks the rule in float64 with the form in the kernel's place."""
import numpy as np

from onnx_autodiff.testing import In, RuleCase

from .contrib_forms import group_query_attention, rotary_embedding

_rng = np.random.default_rng(28)


def _gqa(id, b=2, s=5, n=4, nkv=2, head=16, packed=True, rotary=0, seqlens=None, outputs=1, **attrs):
    """A GroupQueryAttention case over an empty past; ``rotary``: the cos/sin cache width (0: none)."""
    f = dict(dtype="float32")
    if packed:
        qkv = [In((b, s, (n + 2 * nkv) * head), **f), None, None]
    else:
        qkv = [In((b, s, n * head), **f), In((b, s, nkv * head), **f), In((b, s, nkv * head), **f)]
    empty = In(value=np.zeros((b, nkv, 0, head)), **f)
    lengths = np.asarray(seqlens if seqlens is not None else [s - 1] * b)
    inputs = qkv + [empty, empty, In(value=lengths, dtype="int32"), In(value=np.array(s), dtype="int32")]
    if rotary:
        angles = _rng.uniform(0.0, 3.0, (16, rotary))
        inputs += [In(value=np.cos(angles), **f), In(value=np.sin(angles), **f)]
    return RuleCase("GroupQueryAttention", inputs, attrs={"num_heads": n, "kv_num_heads": nkv,
                                                          "do_rotary": int(bool(rotary)), **attrs},
                    domain="com.microsoft", opset=21, outputs=outputs, id=id,
                    reference=group_query_attention(head, rotary))


CASES = [
    _gqa("packed-rotary-padded", rotary=8, seqlens=[4, 2]),
    _gqa("separate-interleaved-partial", packed=False, head=32, rotary=8, seqlens=[4, 1],
         rotary_interleaved=1),
    _gqa("no-rotary-bidirectional", head=8, seqlens=[3, 4], causal=0),
    _gqa("mha-scale", n=2, nkv=2, head=8, b=3, s=4, seqlens=[3, 0, 2], scale=0.3),
    _gqa("present-outputs-groups-of-3", n=6, rotary=8, seqlens=[4, 3], outputs=3),
    _gqa("mqa-separate", packed=False, n=4, nkv=1, head=16, s=6, rotary=8),
    # Gemma2 / Gemma3 as the builder writes them: softcap (Gemma2's 50.0, here small enough that tanh bends), a
    # local window (sliding-window layers), both, padded rows whose window ends at their last token
    _gqa("softcap", rotary=8, seqlens=[4, 3], softcap=1.5),
    _gqa("local-window-padded", s=7, rotary=8, seqlens=[6, 3], local_window_size=3),
    _gqa("window-softcap-separate", packed=False, s=7, seqlens=[6, 4], local_window_size=2, softcap=2.0,
         outputs=3),
]


def _rope(id, offset=False, heads=3, head=16, rotary_dim=0, **attrs):
    """com.microsoft RotaryEmbedding on [2, 5, heads * head]; positions per token or from an offset."""
    b, s = 2, 5
    width = (rotary_dim or head) // 2
    angles = _rng.uniform(0.0, 3.0, (32, width))
    pos = np.array([3]) if offset else _rng.integers(0, 32, (b, s))
    if rotary_dim:
        attrs.update(rotary_embedding_dim=rotary_dim, num_heads=heads)
    inputs = [In((b, s, heads * head), dtype="float32"), In(value=pos, dtype="int64"),
              In(value=np.cos(angles), dtype="float32"), In(value=np.sin(angles), dtype="float32")]
    return RuleCase("RotaryEmbedding", inputs, attrs=attrs, domain="com.microsoft", opset=21, id=id,
                    reference=rotary_embedding(heads, head, offset))


CASES += [
    _rope("positions"),
    _rope("offset-interleaved", offset=True, interleaved=1),
    _rope("partial-interleaved", rotary_dim=8, interleaved=1),
    _rope("partial-offset", offset=True, rotary_dim=8),
]

"""The float64 oracle itself: checked against a per-row loop and against finite differences."""
import numpy as np
import pytest

from flashrt import reference


def _rand(rng, *shape):
    return rng.standard_normal(shape)


def _loop_attention(q, k, v, causal, scale):
    B, Sq, H, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    out = np.zeros_like(q)
    lse = np.full((B, H, Sq), -np.inf)
    for b in range(B):
        for h in range(H):
            for i in range(Sq):
                keys = [j for j in range(Sk) if not causal or j <= i + Sk - Sq]
                if not keys:
                    continue
                s = np.array([q[b, i, h] @ k[b, j, h // (H // Hkv)] * scale for j in keys])
                lse[b, h, i] = np.log(np.exp(s - s.max()).sum()) + s.max()
                p = np.exp(s - lse[b, h, i])
                out[b, i, h] = sum(pj * v[b, j, h // (H // Hkv)] for pj, j in zip(p, keys))
    return out, lse


@pytest.mark.parametrize("Sq,Sk,causal", [(5, 7, False), (7, 5, True), (5, 7, True), (4, 4, True)])
def test_forward_matches_loop(Sq, Sk, causal):
    rng = np.random.default_rng(0)
    q, k, v = _rand(rng, 2, Sq, 4, 8), _rand(rng, 2, Sk, 2, 8), _rand(rng, 2, Sk, 2, 8)
    out, lse = reference.attention(q, k, v, causal=causal, softmax_scale=0.3)
    want_out, want_lse = _loop_attention(q, k, v, causal, 0.3)
    np.testing.assert_allclose(out, want_out, atol=1e-12)
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(want_lse))
    np.testing.assert_allclose(lse[np.isfinite(lse)], want_lse[np.isfinite(want_lse)], atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_gradients_match_finite_differences(causal):
    rng = np.random.default_rng(1)
    q, k, v, do = _rand(rng, 1, 4, 4, 8), _rand(rng, 1, 6, 2, 8), _rand(rng, 1, 6, 2, 8), _rand(rng, 1, 4, 4, 8)
    _, _, dq, dk, dv = reference.attention(q, k, v, causal=causal, dout=do)

    def loss(q_, k_, v_):
        return float((reference.attention(q_, k_, v_, causal=causal)[0] * do).sum())

    eps = 1e-6
    for x, grad, i in ((q, dq, 0), (k, dk, 1), (v, dv, 2)):
        for idx in [(0, 1, 1, 3), (0, 3, 0, 7), (0, 0, 1, 0)]:
            args = [q.copy(), k.copy(), v.copy()]
            args[i][idx] += eps
            up = loss(*args)
            args[i][idx] -= 2 * eps
            down = loss(*args)
            assert abs((up - down) / (2 * eps) - grad[idx]) < 1e-6


def test_rel_error():
    ref = np.ones(4)
    assert reference.rel_error(ref, ref) == 0
    assert reference.rel_error(ref * 1.5, ref) == pytest.approx(0.5)
    assert reference.rel_error(np.array([np.nan, 1, 1, 1]), ref) == np.inf

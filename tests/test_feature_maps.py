"""Feature maps: formulas, unbiasedness of PRF, head-wise masking, stability, registry and errors."""

from __future__ import annotations

import math

import pytest
import torch
from ops_helpers import (
    weighted_gradients,
)

from dofla.errors import DoflaError
from dofla.feature_maps import FEATURE_MAPS, FeatureMap, build_feature_map, register_feature_map
from dofla.ops import LinearInputs, chunked_linear_attention, linear_attention

ALL_MAPS = ("prf", "learnable_prf", "hedgehog", "t2r", "elu1", "dijiang")


def build(name, num_heads=2, head_dim=8, feature_dim=16, scaling=8**-0.5, **options):
    return build_feature_map(
        name, num_heads=num_heads, head_dim=head_dim, feature_dim=feature_dim, scaling=scaling, **options
    )


def true_features(feature_map, x):
    """phi * exp(log_scale) in float64: the features the map stands for."""
    features, log_scale = feature_map(x, is_query=False)
    features = features.double()
    return features if log_scale is None else features * log_scale.double().exp()[..., None]


def test_registry_holds_every_map():
    assert set(ALL_MAPS) <= set(FEATURE_MAPS)
    for name in ALL_MAPS:
        feature_map = build(name)
        assert (
            isinstance(feature_map, FeatureMap)
            and feature_map.num_heads == 2
            and feature_map.feature_dim == 16
        )


def test_prf_features_follow_the_formula_exactly():
    feature_map = build("prf", num_heads=2, head_dim=8, feature_dim=12, scaling=0.3)
    x = torch.randn(2, 4, 5, 8)  # 4 heads over 2 map heads: heads 0, 1 use set 0; heads 2, 3 use set 1
    directions = feature_map.random_directions.double()  # (2, 8, 12)
    expected = torch.stack(
        [
            torch.exp(
                math.sqrt(0.3) * x[:, h].double() @ directions[h // 2]
                - 0.15 * x[:, h].double().square().sum(-1, keepdim=True)
            )
            / math.sqrt(12)
            for h in range(4)
        ],
        dim=1,
    )
    assert torch.allclose(true_features(feature_map, x), expected, rtol=1e-5)
    queries, log_scale = feature_map(x, is_query=True)
    assert log_scale is None
    ratio = queries.double() / expected  # queries differ only by a per-token factor
    assert torch.allclose(ratio, ratio[..., :1].expand_as(ratio), rtol=1e-5)
    assert torch.allclose(queries.amax(-1), torch.ones(2, 4, 5))  # largest feature of each token is 1


def test_prf_is_an_unbiased_estimate_of_the_softmax_kernel():
    torch.manual_seed(0)
    scaling, head_dim = 8**-0.5, 8
    x, y = 0.5 * torch.randn(1, 1, 4, head_dim), 0.5 * torch.randn(1, 1, 4, head_dim)
    exact = torch.exp(scaling * x.double() @ y.double().transpose(-1, -2))  # (1, 1, 4, 4)
    estimates = []
    for seed in range(4):
        feature_map = build(
            "prf", num_heads=1, head_dim=head_dim, feature_dim=8192, scaling=scaling, seed=seed
        )
        estimates.append(true_features(feature_map, x) @ true_features(feature_map, y).transpose(-1, -2))
    mean = torch.stack(estimates).mean(0)
    assert (mean / exact - 1).abs().max() < 0.03
    # A single small draw is far off: the test above is not trivially satisfied.
    small = build("prf", num_heads=1, head_dim=head_dim, feature_dim=2, scaling=scaling, seed=0)
    assert (
        true_features(small, x) @ true_features(small, y).transpose(-1, -2) / exact - 1
    ).abs().max() > 0.03


def test_prf_linear_attention_approaches_softmax_attention_with_many_features():
    torch.manual_seed(1)
    scaling, head_dim, length = 8**-0.5, 8, 12
    query, key = 0.5 * torch.randn(1, 2, length, head_dim), 0.5 * torch.randn(1, 2, length, head_dim)
    v = torch.randn(1, 2, length, 4)
    softmax = torch.nn.functional.scaled_dot_product_attention(query, key, v, is_causal=True, scale=scaling)
    feature_map = build("prf", num_heads=2, head_dim=head_dim, feature_dim=4096, scaling=scaling)
    q_features, _ = feature_map(query, is_query=True)
    k_features, k_log_scale = feature_map(key, is_query=False)
    linear = chunked_linear_attention(LinearInputs(q_features, k_features, v, k_log_scale), chunk_size=4)
    assert (linear - softmax).norm() / softmax.norm() < 0.05


def test_prf_redraw_is_seeded_and_changes_the_directions():
    feature_map = build("prf", seed=3)
    first = feature_map.random_directions.clone()
    feature_map.redraw(seed=4)
    assert not torch.allclose(first, feature_map.random_directions)
    feature_map.redraw(seed=3)
    assert torch.equal(first, feature_map.random_directions)
    assert not list(feature_map.parameters()) and feature_map.parameter_groups(0.1) == []


def test_learnable_prf_equals_prf_at_initialisation_and_trains():
    prf, learnable = build("prf", seed=5), build("learnable_prf", seed=5)
    x = torch.randn(2, 4, 6, 8)
    for is_query in (True, False):
        (fixed, fixed_scale), (learned, learned_scale) = (
            prf(x, is_query=is_query),
            learnable(x, is_query=is_query),
        )
        assert torch.allclose(fixed, learned) and (fixed_scale is None) == (learned_scale is None)
        if fixed_scale is not None:
            assert torch.allclose(fixed_scale, learned_scale)
    features, _ = learnable(x, is_query=True)
    features.sum().backward()
    assert learnable.z.grad.abs().sum() > 0 and learnable.log_alpha.grad.abs().sum() > 0


def test_learnable_prf_parameter_groups_use_the_papers_rates_unless_overridden():
    groups = build("learnable_prf").parameter_groups(base_lr=1e-3)
    assert [group["lr"] for group in groups] == [0.02, 0.2]
    feature_map = build("learnable_prf", z_lr=0.01, alpha_lr=0.5)
    groups = feature_map.parameter_groups(base_lr=1e-3)
    assert [group["lr"] for group in groups] == [0.01, 0.5]
    assert groups[0]["params"][0] is feature_map.z and groups[1]["params"][0] is feature_map.log_alpha
    torch.optim.AdamW(groups)  # accepted as is
    hedgehog_groups = build("hedgehog").parameter_groups(base_lr=1e-2)
    assert len(hedgehog_groups) == 1 and hedgehog_groups[0]["lr"] == 1e-2


def test_hedgehog_is_a_pair_of_softmaxes_starting_from_the_identity():
    feature_map = build("hedgehog", num_heads=1, head_dim=8, feature_dim=16)
    assert torch.equal(feature_map.weight[0], torch.eye(8))
    x = torch.randn(1, 3, 5, 8)
    features, log_scale = feature_map(x, is_query=True)
    assert log_scale is None
    assert torch.allclose(features[..., 0::2], torch.softmax(x, -1), atol=1e-6)
    assert torch.allclose(features[..., 1::2], torch.softmax(-x, -1), atol=1e-6)


def test_elu1_starts_as_elu_plus_one_and_t2r_is_relu_of_an_affine_map():
    x = torch.randn(1, 2, 5, 8)
    features, _ = build("elu1", feature_dim=8)(x, is_query=True)
    assert torch.allclose(features, torch.nn.functional.elu(x) + 1)
    t2r = build("t2r", num_heads=2, feature_dim=6)
    with torch.no_grad():
        t2r.bias.fill_(0.1)
    features, _ = t2r(x, is_query=False)
    expected = torch.relu(torch.einsum("bhtd,hdf->bhtf", x, t2r.weight) + 0.1)
    assert torch.allclose(features, expected, atol=1e-6)


def test_dijiang_is_a_softmax_over_dct_coefficients_scaled_by_gaussian_points():
    from scipy.fft import dct

    feature_map = build("dijiang", num_heads=1, head_dim=8, feature_dim=16)
    x = torch.randn(1, 2, 5, 8)
    coefficients = torch.from_numpy(dct(x.double().numpy(), norm="ortho", axis=-1))  # (1, 2, 5, 8)
    logits = torch.einsum("bhtd,df->bhtf", x.double(), feature_map.projection[0].double())  # (1, 2, 5, 16)
    features, _ = feature_map(x, is_query=False)
    assert torch.allclose(features.double(), torch.softmax(logits, -1), atol=1e-6)
    # Feature f is DCT coefficient f mod 8 times a fixed point; the points are the Gaussian quantiles.
    point_per_feature = logits / coefficients[..., torch.arange(16) % 8]
    assert torch.allclose(
        point_per_feature, point_per_feature[:1, :1, :1].expand_as(point_per_feature), atol=1e-5
    )
    quantiles = torch.distributions.Normal(0.0, 1.0).icdf((torch.arange(16, dtype=torch.float64) + 0.5) / 16)
    assert torch.allclose(point_per_feature[0, 0, 0].sort().values, quantiles, atol=1e-5)
    with torch.no_grad():
        feature_map.log_weight.fill_(1.0)
    weighted, _ = feature_map(x, is_query=False)
    assert torch.allclose(weighted, features * torch.e, rtol=1e-5)


@pytest.mark.parametrize("name", ALL_MAPS)
def test_headwise_dims_give_exact_zeros_and_no_gradient_through_them(name):
    feature_map = build(name, num_heads=2, feature_dim=16, head_feature_dims=[16, 6])
    x = torch.randn(2, 4, 5, 8, requires_grad=True)
    for is_query in (True, False):
        features, _ = feature_map(x, is_query=is_query)
        assert (features[:, 2:, :, 6:] == 0).all()  # heads 2, 3 read map head 1, which has 6 features
        assert (features[:, :2, :, 6:] > 0).any()
    # The extra features of head 1 have no effect: changing their parameters changes nothing.
    features, _ = feature_map(x, is_query=False)
    (features * torch.randn_like(features)).sum().backward()
    for parameter_name, parameter in feature_map.named_parameters():
        if parameter_name in ("weight", "z") and parameter.shape[-1] == 8:  # hedgehog: F/2 columns
            assert (parameter.grad[1, :, 3:] == 0).all()
        elif parameter_name in ("weight", "z", "log_alpha", "bias"):
            assert (parameter.grad[1, ..., 6:] == 0).all(), parameter_name


def test_headwise_prf_head_uses_its_own_feature_count_for_normalisation():
    feature_map = build(
        "prf", num_heads=2, head_dim=8, feature_dim=16, scaling=0.3, head_feature_dims=[16, 6]
    )
    x = torch.randn(1, 2, 3, 8).double()
    directions = feature_map.random_directions.double()[1, :, :6]
    expected = torch.exp(
        math.sqrt(0.3) * x[:, 1] @ directions - 0.15 * x[:, 1].square().sum(-1, keepdim=True)
    )
    assert torch.allclose(
        true_features(feature_map, x.float())[:, 1, :, :6], expected / math.sqrt(6), rtol=1e-5
    )


@pytest.mark.parametrize("name", ALL_MAPS)
def test_bfloat16_inputs_of_huge_norm_give_finite_non_negative_features(name):
    feature_map = build(name, num_heads=1, head_dim=16, feature_dim=16, scaling=0.25)
    x = (1000 * torch.randn(1, 2, 64, 16)).bfloat16()
    for is_query in (True, False):
        features, log_scale = feature_map(x, is_query=is_query)
        assert features.dtype == torch.bfloat16 and torch.isfinite(features).all() and (features >= 0).all()
        if log_scale is not None:
            assert torch.isfinite(log_scale).all() and log_scale.dtype == torch.float32


def test_errors_name_the_value_and_what_to_do():
    with pytest.raises(DoflaError, match="unknown feature map 'favor'.*hedgehog.*prf"):
        build("favor")
    with pytest.raises(DoflaError, match="feature_dim must be positive, got 0"):
        build("prf", feature_dim=0)
    with pytest.raises(DoflaError, match="even.*got 15"):
        build("hedgehog", feature_dim=15)
    with pytest.raises(DoflaError, match="even.*got 5"):
        build("hedgehog", feature_dim=16, head_feature_dims=[16, 5])
    with pytest.raises(DoflaError, match="3 entries for 2 map heads"):
        build("prf", head_feature_dims=[4, 4, 4])
    with pytest.raises(DoflaError, match=r"must lie in 1..feature_dim \(16\)"):
        build("prf", head_feature_dims=[4, 17])
    with pytest.raises(DoflaError, match="no option z_lr; its options are: seed"):
        build("prf", z_lr=0.1)
    with pytest.raises(DoflaError, match="got an input with 3 heads"):
        build("prf")(torch.randn(1, 3, 4, 8), is_query=True)


def test_register_feature_map_refuses_a_second_class_under_one_name():
    with pytest.raises(ValueError, match="already registered"):

        @register_feature_map("prf")
        class Other(FeatureMap):
            pass


@pytest.mark.parametrize("name", ALL_MAPS)
def test_maps_cast_to_bfloat16_still_run_and_save_only_what_they_learn_or_drew(name):
    feature_map = build(name, head_feature_dims=[16, 10])
    state = feature_map.state_dict()
    assert "feature_mask" not in state  # derived from the config
    assert ("random_directions" in state) == (name == "prf")
    feature_map = feature_map.to(torch.bfloat16)  # e.g. inside a bf16 model
    features, _ = feature_map(torch.randn(1, 4, 3, 8).bfloat16(), is_query=False)
    assert features.dtype == torch.bfloat16 and torch.isfinite(features).all()


def test_stabilised_prf_through_the_ops_has_the_gradient_of_the_plain_formula():
    """exp(log_features) straight into the reference vs max-subtracted features + log scales into the chunked
    form: same outputs and same gradients for the inputs and the learned directions and weights."""
    torch.manual_seed(3)
    feature_map = build("learnable_prf", num_heads=2, head_dim=8, feature_dim=12, scaling=8**-0.5).double()
    with torch.no_grad():
        feature_map.log_alpha.normal_(0, 0.3)
    query = (0.7 * torch.randn(1, 4, 10, 8)).double().requires_grad_()
    key = (0.7 * torch.randn(1, 2, 10, 8)).double().requires_grad_()
    v = torch.randn(1, 2, 10, 3).double()

    def plain_features(x):  # the textbook formula, no stabilisation
        grouped = x.view(1, 2, x.shape[1] // 2, 10, 8)
        log_features = (
            8**-0.25 * torch.einsum("bhgtd,hdf->bhgtf", grouped, feature_map.z)
            - 0.5 * 8**-0.5 * grouped.square().sum(-1, keepdim=True)
            - 0.5 * math.log(12)
            + 0.5 * feature_map.log_alpha[None, :, None, None, :]
        )
        return log_features.exp().reshape(1, x.shape[1], 10, 12)

    outputs, gradients = [], []
    for stabilised in (False, True):
        if stabilised:
            q_features, _ = feature_map(query, is_query=True)
            k_features, k_log_scale = feature_map(key, is_query=False)
            out = chunked_linear_attention(
                LinearInputs(q_features, k_features, v, k_log_scale), chunk_size=4, eps=0
            )
        else:
            out = linear_attention(LinearInputs(plain_features(query), plain_features(key), v), eps=0)
        inputs = [query, key, feature_map.z, feature_map.log_alpha]
        gradients.append(
            torch.autograd.grad((out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum(), inputs)
        )
        outputs.append(out)
    assert torch.allclose(outputs[0], outputs[1], rtol=1e-10)
    for plain, stable in zip(*gradients, strict=True):
        assert torch.allclose(plain, stable, rtol=1e-8, atol=1e-12)


@pytest.mark.parametrize("name", ["prf", "hedgehog"])
def test_feature_map_and_chunked_hybrid_pass_gradcheck(name):
    """float64 end to end: the map, the window softmax and the linear part, against finite differences."""
    from dofla.ops import HybridInputs, HybridOptions, chunked_hybrid_attention

    torch.manual_seed(4)
    feature_map = build(name, num_heads=1, head_dim=4, feature_dim=4, scaling=0.5).double()
    value = torch.randn(1, 1, 7, 3, dtype=torch.float64)
    gamma = torch.tensor([0.3, 0.6], dtype=torch.float64)

    def layer(query, key):
        q_features, _ = feature_map(query, is_query=True)
        k_features, k_log_scale = feature_map(key, is_query=False)
        return chunked_hybrid_attention(
            HybridInputs(query, key, q_features, k_features, value, gamma, k_log_scale),
            HybridOptions(scaling=0.5, window=3),
            chunk_size=4,
        )

    query = torch.randn(1, 2, 7, 4, dtype=torch.float64, requires_grad=True)
    key = torch.randn(1, 1, 7, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(layer, (query, key))


def test_projection_map_is_signed_identity_at_start_and_refused_by_normalised_cells():
    from dofla.attention import LinearAttention
    from dofla.config import LayerPlan

    feature_map = build("projection", num_heads=2, head_dim=8, feature_dim=8)
    x = torch.randn(2, 4, 5, 8)
    features, log_scale = feature_map(x, is_query=False)
    assert log_scale is None and not feature_map.nonnegative
    torch.testing.assert_close(features, x)  # rectangular identity: the teacher's own vectors
    narrower = build("projection", num_heads=2, head_dim=8, feature_dim=3)
    torch.testing.assert_close(narrower(x, is_query=True)[0], x[..., :3])
    plan = LayerPlan(feature_map="projection", feature_dim=8)
    with pytest.raises(DoflaError, match="needs a non-negative feature map; 'projection' is signed"):
        LinearAttention(plan, layer_index=0, num_heads=4, num_kv_heads=2, head_dim=8, scaling=0.3)


def test_taylor_features_give_the_second_order_expansion_of_exp():
    from dofla.feature_maps.taylor import taylor_rank

    assert [taylor_rank(f) for f in (2, 3, 6, 7, 57, 64, 111, 273)] == [0, 1, 1, 2, 7, 7, 10, 16]
    feature_map = build("taylor", num_heads=2, head_dim=8, feature_dim=16, scaling=0.3).double()
    assert feature_map.rank == 3 and not feature_map.nonnegative and feature_map.positive_kernel
    query, key = torch.randn(1, 4, 5, 8).double(), torch.randn(1, 2, 6, 8).double()
    q_features, q_scale = feature_map(query, is_query=True)
    k_features, k_scale = feature_map(key, is_query=False)
    assert q_scale is None and k_scale is None and (q_features[..., 13:] == 0).all()
    weight = feature_map.weight.detach()
    for head in range(4):
        projected_q = query[:, head] @ weight[head // 2]
        projected_k = key[:, head // 2] @ weight[head // 2]
        s = 0.3 * projected_q @ projected_k.transpose(-1, -2)
        kernel = q_features[:, head] @ k_features[:, head // 2].transpose(-1, -2)
        torch.testing.assert_close(kernel, 1 + s + s.square() / 2)
        assert (kernel >= 0.5 - 1e-12).all()  # positive for every s


def test_taylor_head_with_fewer_features_is_the_same_map_with_a_smaller_rank():
    full = build("taylor", num_heads=2, head_dim=8, feature_dim=16, scaling=0.3).double()
    headwise = build(
        "taylor", num_heads=2, head_dim=8, feature_dim=16, scaling=0.3, head_feature_dims=[16, 7]
    )
    headwise = headwise.double()
    with torch.no_grad():
        headwise.weight.copy_(full.weight)
    x = torch.randn(1, 2, 5, 8).double()
    features, _ = headwise(x, is_query=False)
    torch.testing.assert_close(features[:, 0], full(x, is_query=False)[0][:, 0])
    assert (features[:, 1, :, 7:] == 0).all()  # rank 2: 1 + 2 + 4 features
    y = 0.3**0.5 * x[:, 1] @ full.weight.detach()[1, :, :2]
    s = y @ y.transpose(-1, -2)
    torch.testing.assert_close(features[:, 1] @ features[:, 1].transpose(-1, -2), 1 + s + s.square() / 2)


def test_taylor_features_serve_normalised_linear_attention_chunked_as_naive():
    from dofla.cells import build_student
    from dofla.config import LayerPlan

    torch.manual_seed(0)
    feature_map = build("taylor", num_heads=2, head_dim=8, feature_dim=13, scaling=8**-0.5).double()
    query = torch.randn(1, 4, 19, 8).double().requires_grad_()
    key = torch.randn(1, 2, 19, 8).double().requires_grad_()
    v = torch.randn(1, 2, 19, 3).double()
    outputs, gradients = [], []
    for chunked in (False, True):
        q_features, _ = feature_map(query, is_query=True)
        k_features, _ = feature_map(key, is_query=False)
        if chunked:
            out = chunked_linear_attention(LinearInputs(q_features, k_features, v), chunk_size=4)
        else:
            out = linear_attention(LinearInputs(q_features, k_features, v))
        outputs.append(out)
        gradients.append(torch.autograd.grad(out.sin().sum(), [query, key, feature_map.weight]))
    torch.testing.assert_close(outputs[1], outputs[0])
    for got, expected in zip(gradients[1], gradients[0], strict=True):
        torch.testing.assert_close(got, expected)
    for cell in ("linear", "gla", "gated_delta"):  # a positive kernel: normalised cells take it too
        plan = LayerPlan(feature_map="taylor", feature_dim=13, cell=cell)
        build_student(plan, layer_index=0, num_heads=4, num_kv_heads=2, head_dim=8, scaling=0.3)


def test_taylor_with_too_few_features_is_one_sentence():
    with pytest.raises(DoflaError, match="at least 3 features.*got 2"):
        build("taylor", feature_dim=2)
    with pytest.raises(DoflaError, match="at least 3 features per head"):
        build("taylor", feature_dim=16, head_feature_dims=[16, 2])


@pytest.mark.parametrize("name", ["prf", "learnable_prf"])
def test_prf_rows_alone_agree_with_the_batch_and_missing_features_are_zero(name):
    from dofla.feature_maps import build_feature_map

    feature_map = build_feature_map(
        name, num_heads=2, head_dim=8, feature_dim=6, scaling=8**-0.5, head_feature_dims=[6, 4]
    ).double()
    x = torch.randn(3, 4, 5, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    batched, batched_scale = feature_map(x, is_query=False)
    for row in range(3):
        alone, alone_scale = feature_map(x[row : row + 1], is_query=False)
        torch.testing.assert_close(alone, batched[row : row + 1], rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(alone_scale, batched_scale[row : row + 1], rtol=1e-12, atol=1e-12)
    assert torch.all(batched[:, 2:, :, 4:] == 0)  # the second map head has 4 features: the rest exactly 0


@pytest.mark.parametrize("name", ["prf", "learnable_prf"])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("is_query", [False, True])
def test_prf_forward_matches_the_reference_formula_and_follows_parameter_updates(name, batch, is_query):
    """The regrouped PRF (one product, the norm only in the log scale) against the formula as written:
    forward and gradients, with head-wise dimensions; without gradients its folded weights are kept, and
    rebuilt once a parameter changes in place (an optimiser step, a load)."""
    from dofla.feature_maps import build_feature_map

    feature_map = build_feature_map(
        name, num_heads=2, head_dim=8, feature_dim=6, scaling=8**-0.5, head_feature_dims=[6, 4]
    ).double()
    with torch.no_grad():
        for parameter in feature_map.parameters():
            parameter.add_(0.3 * torch.randn_like(parameter))
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(batch, 4, 3, 8, generator=generator, dtype=torch.float64, requires_grad=True)
    expected = feature_map.reference_forward(x, is_query=is_query)
    got = feature_map(x, is_query=is_query)
    assert (got[1] is None) == (expected[1] is None) == is_query
    for a, b in zip(got, expected, strict=True):
        if b is not None:
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)
    weights = [torch.randn(t.shape, generator=generator, dtype=t.dtype) for t in expected if t is not None]
    inputs = (x, *[p for p in feature_map.parameters() if p.requires_grad])
    for a, b in zip(
        weighted_gradients(got, weights, inputs), weighted_gradients(expected, weights, inputs), strict=True
    ):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    with torch.no_grad():
        feature_map(x, is_query=is_query)  # folded weights kept from here
        feature_map.directions().mul_(1.5)
        got = feature_map(x, is_query=is_query)
        expected = feature_map.reference_forward(x, is_query=is_query)
        for a, b in zip(got, expected, strict=True):
            if b is not None:
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)


def test_prf_key_with_an_overflowing_norm_is_not_silently_dropped():
    """A key whose squared norm overflows float32 makes the attention non-finite with the regrouped map,
    as with the formula as written (not a key of weight 0: a diverged run must show as NaN)."""
    from dofla.feature_maps import build_feature_map

    feature_map = build_feature_map("learnable_prf", num_heads=1, head_dim=8, feature_dim=6, scaling=8**-0.5)
    query, key, value = torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 3)
    key[0, 0, 1] = 1e20  # finite, but its squared norm is not
    for features in (feature_map, feature_map.reference_forward):
        q_features, _ = features(query, is_query=True)
        k_features, k_log_scale = features(key, is_query=False)
        out = chunked_linear_attention(LinearInputs(q_features, k_features, value, k_log_scale), chunk_size=2)
        assert torch.isnan(out[:, :, 1:]).all()  # every query that sees the key

"""Device request normalization and constraint matching (docs/DESIGN.md, "Vocabulary")."""

from __future__ import annotations

import pytest
from policy_factories import cpu_job, eq, job

from iris.policy import Constraint, DeviceRequest, JobShape, Op, first_unmatched, job_constraints, matches
from iris.policy.routing import device_request


class TestDeviceRequest:
    def test_defaults_to_cpu(self) -> None:
        assert device_request(None, None, 0, 1) == DeviceRequest(
            type="cpu", variant="auto", count=0, replicas=1
        )

    def test_variant_shorthand_for_gpu(self) -> None:
        assert device_request("H100", None, 8, 2) == DeviceRequest(
            type="gpu", variant="h100", count=8, replicas=2
        )

    def test_tpu_shorthand(self) -> None:
        req = device_request("TPU-v9", None, 0, 1)
        assert (req.type, req.variant) == ("tpu", "tpu-v9")

    def test_explicit_type_and_variant_lowercased(self) -> None:
        req = device_request(" GPU ", "A100", 4, 1)
        assert (req.type, req.variant, req.count) == ("gpu", "a100", 4)

    def test_variant_alone_implies_type(self) -> None:
        assert device_request(None, "h100", 8, 1).type == "gpu"
        assert device_request(None, "tpu-v5p", 0, 1).type == "tpu"

    def test_gpu_count_alone_implies_gpu_auto(self) -> None:
        req = device_request(None, None, 2, 1)
        assert (req.type, req.variant) == ("gpu", "auto")

    def test_auto_variant_is_kept_as_auto(self) -> None:
        assert device_request("gpu", "AUTO", 1, 1).variant == "auto"

    def test_tpu_without_count_is_allowed(self) -> None:
        assert device_request("tpu", "tpu-v5p", 0, 4).total == 0

    def test_same_shorthand_and_variant_agree(self) -> None:
        assert device_request("h100", "H100", 8, 1).variant == "h100"

    @pytest.mark.parametrize(
        ("dtype", "variant", "count", "replicas", "fragment"),
        [
            ("gpu", None, -1, 1, "--gpu-count must be >= 0"),
            ("gpu", None, 1, 0, "--replicas must be >= 1"),
            ("gpu", None, 4097, 1, "maximum of 4096"),
            ("gpu", None, 1, 5000, "maximum of 4096"),
            ("cpu", None, 8, 1, "needs a GPU device type"),
            ("cpu", "h100", 0, 1, "not valid for --device-type cpu"),
            ("gpu", None, 0, 1, "needs --gpu-count >= 1"),
            ("h100", None, 0, 1, "--device-type h100 needs --gpu-count >= 1"),
            ("h100", "a100", 8, 1, "conflicts with --device-variant a100"),
            ("gpu", "tpu-v5p", 8, 1, "is a TPU, not a GPU"),
            ("tpu", "h100", 0, 1, "not a TPU variant"),
            ("g p u", None, 1, 1, "invalid device type"),
        ],
    )
    def test_bad_input_is_one_line_value_error(
        self, dtype: str, variant: str | None, count: int, replicas: int, fragment: str
    ) -> None:
        with pytest.raises(ValueError, match=None) as info:
            device_request(dtype, variant, count, replicas)
        message = str(info.value)
        assert fragment in message
        assert "\n" not in message


class TestJobConstraints:
    def test_gpu_variant_job(self) -> None:
        assert job_constraints(job(variant="h100")) == (
            eq("device-type", "gpu"),
            eq("device-variant", "h100"),
        )

    def test_cpu_job_has_no_routing_constraints(self) -> None:
        assert job_constraints(cpu_job()) == ()

    def test_auto_variant_only_constrains_type(self) -> None:
        assert job_constraints(job(variant=None, device_type="gpu", count=1)) == (eq("device-type", "gpu"),)

    def test_explicit_constraints_lowercased_and_non_routing_dropped(self) -> None:
        shape = cpu_job(
            constraints=(
                Constraint(key="Region", op=Op.IN, values=("US-East", "us-west")),
                Constraint(key="team", op=Op.EQ, values=("ml",)),
                Constraint(key="device-type", op=Op.EQ, values=("CPU",)),
                Constraint(key="gpu-count", op=Op.EQ, values=("8",)),
            )
        )
        assert job_constraints(shape) == (Constraint(key="region", op=Op.IN, values=("us-east", "us-west")),)

    def test_duplicates_collapse(self) -> None:
        shape = job(constraints=(eq("device-variant", "H100"), eq("zone", "a")))
        assert job_constraints(shape) == (
            eq("device-type", "gpu"),
            eq("device-variant", "h100"),
            eq("zone", "a"),
        )

    def test_explicit_device_type_on_cpu_request_is_kept(self) -> None:
        shape = JobShape(job_id="j", constraints=(eq("device-type", "GPU"),))
        assert job_constraints(shape) == (eq("device-type", "gpu"),)


class TestMatches:
    attrs = {"Device-Type": ["GPU"], "device-variant": ["h100", "A100"], "region": ["us-east"], "zone": []}

    @pytest.mark.parametrize(
        ("constraint", "expected"),
        [
            (eq("device-variant", "H100"), True),
            (eq("device-variant", "a100"), True),
            (eq("device-variant", "h200"), False),
            (eq("device-type", "gpu"), True),
            (Constraint(key="region", op=Op.NE, values=("us-west",)), True),
            (Constraint(key="region", op=Op.NE, values=("US-EAST",)), False),
            # Multi-valued: some advertised variant is not h100.
            (Constraint(key="device-variant", op=Op.NE, values=("h100",)), True),
            (Constraint(key="device-variant", op=Op.NOT_IN, values=("h100", "a100")), False),
            (Constraint(key="device-variant", op=Op.IN, values=("h200", "A100")), True),
            (Constraint(key="device-variant", op=Op.IN, values=("h200",)), False),
            (Constraint(key="region", op=Op.EXISTS), True),
            (Constraint(key="region", op=Op.NOT_EXISTS), False),
            # Missing keys (and keys advertising no value) fail all but NOT_EXISTS.
            (eq("preemptible", "true"), False),
            (Constraint(key="preemptible", op=Op.NE, values=("true",)), False),
            (Constraint(key="preemptible", op=Op.NOT_IN, values=("true",)), False),
            (Constraint(key="preemptible", op=Op.IN, values=("true",)), False),
            (Constraint(key="preemptible", op=Op.EXISTS), False),
            (Constraint(key="preemptible", op=Op.NOT_EXISTS), True),
            (Constraint(key="zone", op=Op.EXISTS), False),
            (Constraint(key="zone", op=Op.NOT_EXISTS), True),
            (Constraint(key="ZONE", op=Op.NE, values=("a",)), False),
        ],
    )
    def test_operator(self, constraint: Constraint, expected: bool) -> None:
        assert matches((constraint,), self.attrs) is expected

    def test_empty_constraints_match_anything(self) -> None:
        assert matches((), {})

    def test_first_unmatched_reports_the_failing_constraint(self) -> None:
        cs = (eq("device-type", "gpu"), eq("region", "us-west"), eq("zone", "z"))
        assert first_unmatched(cs, self.attrs) == eq("region", "us-west")
        assert first_unmatched(cs[:1], self.attrs) is None

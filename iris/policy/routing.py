"""Device requests and routing constraints (docs/DESIGN.md, "Vocabulary").

Normalizes what a user typed into a :class:`DeviceRequest`, derives a job's routing constraints,
and matches constraints against a backend's advertised attributes.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence

from iris.policy.models import DEVICE_TYPES, ROUTING_KEYS, Constraint, DeviceRequest, JobShape, Op

# Upper bound on any count a user may ask for; larger values are typos, not jobs.
MAX_COUNT = 4096
AUTO_VARIANT = "auto"
_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]*$")


def _clean_name(text: str, what: str) -> str:
    value = text.strip().lower()
    if not _NAME.match(value):
        raise ValueError(f"invalid {what} {text!r}: use letters, digits, '.', '_' or '-'")
    return value


def _type_of_variant(variant: str) -> str:
    return "tpu" if variant.startswith("tpu") else "gpu"


def device_request(
    device_type: str | None, device_variant: str | None, gpu_count: int, replicas: int
) -> DeviceRequest:
    """Normalize the CLI/SDK device flags into a :class:`DeviceRequest`.

    - ``device_type`` is ``cpu``, ``gpu`` or ``tpu``; anything else is shorthand for a variant
      (``h100`` means gpu/h100, ``tpu-v5p`` means tpu/tpu-v5p).
    - With no type, a variant or a positive ``gpu_count`` implies the type; otherwise cpu.
    - A GPU job must ask for at least one GPU: the gate counts chips, and a GPU job with zero
      chips would match GPU backends while reserving nothing.
    - A TPU job may leave ``gpu_count`` at 0: the variant names the slice and TPUs are not gated.
    Raises ValueError with a one-line message on contradictory or out-of-range input.
    """
    if gpu_count < 0:
        raise ValueError(f"--gpu-count must be >= 0, got {gpu_count}")
    if replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {replicas}")
    if gpu_count > MAX_COUNT:
        raise ValueError(f"--gpu-count {gpu_count} is larger than the maximum of {MAX_COUNT}")
    if replicas > MAX_COUNT:
        raise ValueError(f"--replicas {replicas} is larger than the maximum of {MAX_COUNT}")

    variant = _clean_name(device_variant, "device variant") if device_variant else None
    if variant == AUTO_VARIANT:
        variant = None

    if device_type:
        dtype = _clean_name(device_type, "device type")
        if dtype not in DEVICE_TYPES:
            shorthand = dtype
            dtype = _type_of_variant(shorthand)
            if variant is not None and variant != shorthand:
                raise ValueError(
                    f"--device-type {shorthand} already names variant {shorthand!r}; "
                    f"it conflicts with --device-variant {variant}"
                )
            variant = shorthand
    elif variant is not None:
        dtype = _type_of_variant(variant)
    else:
        dtype = "gpu" if gpu_count > 0 else "cpu"

    if dtype == "cpu":
        if gpu_count > 0:
            raise ValueError(f"--gpu-count {gpu_count} needs a GPU device type (e.g. --device-type h100)")
        if variant is not None:
            raise ValueError(f"device variant {variant!r} is not valid for --device-type cpu")
    elif dtype == "gpu":
        if gpu_count == 0:
            shown = variant or "gpu"
            raise ValueError(f"--device-type {shown} needs --gpu-count >= 1 (GPUs per replica)")
        if variant is not None and variant.startswith("tpu"):
            raise ValueError(f"device variant {variant!r} is a TPU, not a GPU")
    elif variant is not None and not variant.startswith("tpu"):
        raise ValueError(f"device variant {variant!r} is not a TPU variant (expected tpu-...)")

    return DeviceRequest(type=dtype, variant=variant or AUTO_VARIANT, count=gpu_count, replicas=replicas)


def normalize_constraint(constraint: Constraint) -> Constraint:
    """Lowercase key and values (docs/DESIGN.md, "Vocabulary": compared case-insensitively)."""
    key = constraint.key.strip().lower()
    values = tuple(v.strip().lower() for v in constraint.values)
    if key == constraint.key and values == constraint.values:
        return constraint
    return Constraint(key=key, op=constraint.op, values=values)


def _is_cpu_type(c: Constraint) -> bool:
    return c.key == "device-type" and c.op is Op.EQ and c.values == ("cpu",)


def routing_constraints(constraints: Iterable[Constraint]) -> tuple[Constraint, ...]:
    """Normalized routing constraints: non-routing keys and ``device-type=cpu`` dropped, deduplicated."""
    out: list[Constraint] = []
    seen: set[Constraint] = set()
    for raw in constraints:
        c = normalize_constraint(raw)
        if c.key not in ROUTING_KEYS or _is_cpu_type(c) or c in seen:
            continue
        seen.add(c)
        out.append(c)
    return tuple(out)


def device_constraints(device: DeviceRequest) -> tuple[Constraint, ...]:
    derived: list[Constraint] = []
    dtype = device.type.strip().lower()
    variant = device.variant.strip().lower()
    if dtype != "cpu":
        derived.append(Constraint(key="device-type", op=Op.EQ, values=(dtype,)))
    if variant and variant != AUTO_VARIANT:
        derived.append(Constraint(key="device-variant", op=Op.EQ, values=(variant,)))
    return tuple(derived)


def job_constraints(job: JobShape) -> tuple[Constraint, ...]:
    """The routing constraints of a job: its device request's, then its explicit ones."""
    return routing_constraints((*device_constraints(job.device), *job.constraints))


def normalize_attributes(attributes: Mapping[str, Sequence[str]]) -> dict[str, frozenset[str]]:
    """Lowercased keys and values; keys advertising no value are dropped (they count as absent)."""
    out: dict[str, frozenset[str]] = {}
    for key, values in attributes.items():
        vals = frozenset(v.strip().lower() for v in values)
        if vals:
            k = key.strip().lower()
            out[k] = out.get(k, frozenset()) | vals
    return out


def constraint_holds(op: Op, wanted: frozenset[str], advertised: frozenset[str] | None) -> bool:
    """One operator against one normalized attribute.

    Attributes are multi-valued (a backend may offer several variants), so a comparison holds if
    some advertised value satisfies it. A missing key fails everything but NOT_EXISTS.
    """
    if op is Op.NOT_EXISTS:
        return not advertised
    if not advertised:
        return False
    if op is Op.EXISTS:
        return True
    if op is Op.EQ or op is Op.IN:
        return not advertised.isdisjoint(wanted)
    # NE / NOT_IN: some advertised value is outside the excluded set.
    return not advertised <= wanted


def _holds(c: Constraint, attrs: Mapping[str, frozenset[str]]) -> bool:
    return constraint_holds(c.op, frozenset(v.lower() for v in c.values), attrs.get(c.key.lower()))


def first_unmatched(
    constraints: Iterable[Constraint], attributes: Mapping[str, Sequence[str]]
) -> Constraint | None:
    """The first constraint the attributes fail, or None when all hold."""
    attrs = normalize_attributes(attributes)
    for c in constraints:
        if not _holds(c, attrs):
            return c
    return None


def matches(constraints: Iterable[Constraint], attributes: Mapping[str, Sequence[str]]) -> bool:
    """Whether a backend advertising ``attributes`` satisfies every constraint (docs/DESIGN.md,
    "Vocabulary")."""
    return first_unmatched(constraints, attributes) is None


def resolve_cluster(name: str, known: Iterable[str]) -> str | None:
    """The known cluster id ``name`` names: an exact match, else the only case-insensitive one."""
    ids = list(known)
    name = name.strip()
    if name in ids:
        return name
    folded = [k for k in ids if k.lower() == name.lower()]
    return folded[0] if len(folded) == 1 else None


def pinned_cluster(target: str | None, known: Iterable[str]) -> str | None:
    """A job's pin as a known cluster id when it resolves, else as given; None when unpinned."""
    if not target or not target.strip():
        return None
    return resolve_cluster(target, known) or target.strip()

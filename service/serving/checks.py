"""Model-aware request checks shared by the serving modules (cheap, before any forward)."""

from __future__ import annotations

from attnscope.service.errors import InvalidRequest, OutOfRange


def check_indices(values: list[int] | None, limit: int, field: str, what: str) -> None:
    """422 unless every index is in [0, limit) and none repeats (so the list has at most
    ``limit`` entries: a repeated index would only multiply the work and the response)."""
    if values is None:
        return
    if len(values) == 0:
        raise OutOfRange(f"{field} must hold at least one {what} index (or be null for all)", field)
    for i, v in enumerate(values):
        check_index(v, limit, what, f"{field}[{i}]", f"{field}.{i}")
    check_distinct(values, field)


def check_index(value: int | None, limit: int, what: str, name: str, param: str | None = None) -> None:
    """422 ``out_of_range`` unless ``value`` (a layer/head index; None = not given) is in
    [0, limit). ``name`` is how the message shows the field, ``param`` the envelope's param
    (default ``name``)."""
    if value is not None and not 0 <= value < limit:
        raise OutOfRange(
            f"{name} = {value} is out of range: the model has {limit} {what}s "
            f"(valid indices 0..{limit - 1})",
            param or name,
        )


def check_distinct(values, field: str) -> None:
    """422 (validation_error, param ``field.<i>``) at the first value that repeats an earlier one."""
    seen: dict[int, int] = {}
    for i, v in enumerate(values):
        if v in seen:
            raise InvalidRequest(
                f"{field}[{i}] = {v} repeats {field}[{seen[v]}]; each index may appear once",
                f"{field}.{i}",
            )
        seen[v] = i

"""A mixture's part of the loader's state, and a changed mixture at resume (new weights, an entry added or removed:
mid-training annealing).

Saved: where the stream's blend started (its origin: epoch, position and each entry's cursor, by name), the
blend's cursors at the first document not yet drawn, the entries of the documents still to be trained (queued,
or begun by a step that ended inside them), and the changes made so far. Loaded with the same mixture, the stream
starts from the saved origin and continues exactly. Loaded with another mixture, the new blend takes over at the
first document not yet drawn: every entry keeps its cursor (its pass order goes on where it stood; an added entry
starts its first pass), the token counts start again at the new weights, the documents still to be trained are
trained as drawn, and the mixture epoch keeps its size. What changed is recorded in the state (`changes`) and
logged. Refused, naming the entry: an entry whose shards differ from the saved state's, a removed entry that still
has documents to train, a change of a repeat/choose mixture, a state saved inside a step.
"""

from __future__ import annotations

import logging

import msgspec

from packloader.sources.mixture import BlendState, MixtureError

log = logging.getLogger("packloader")


def _entry_of(shard_key: str) -> str:
    return shard_key.split(":", 1)[0]


def _pending_ids(step_state: dict | None, num_docs: int) -> list[int]:
    if step_state is None:
        return []
    out = [int(q[0]) if isinstance(q, list) else int(q["doc"]) for q in step_state["planner"]["queued"]]
    if step_state.get("offset"):
        out.append(int(step_state["epoch"]) * num_docs + int(step_state["pos"]))
    return out


def mixture_state(stream, step_state: dict | None, changes: list) -> dict | None:
    """The mixture's part of `state_dict()` (None for a single source)."""
    if not hasattr(stream, "entry_of"):
        return None
    names = stream.names
    epoch, pos = (0, 0) if step_state is None else (int(step_state["epoch"]), int(step_state["pos"]))
    if step_state is not None and step_state.get("offset"):
        pos += 1  # the document a step ended inside stays this blend's
    pending = _pending_ids(step_state, stream.num_docs)
    ent, idx = stream.route(pending) if pending else ([], [])
    origin = stream.blend_state(stream.origin[0])
    if (epoch, pos) < stream.origin:  # a position before the stream's blend began (a loader not yet resumed)
        epoch, pos = stream.origin
    at = stream.blend_at(epoch, pos) if pos < stream.num_docs else stream.blend_state(epoch + 1)
    return {
        "origin": {"epoch": stream.origin[0], "pos": stream.origin[1],
                   "cursors": dict(zip(names, origin.cursors)), "tokens": dict(zip(names, origin.tokens)),
                   "total": origin.total,
                   "pending": [[d, names[e], int(i)] for d, e, i in zip(pending, list(ent), list(idx))]},
        "at": {"epoch": epoch, "pos": pos, "cursors": dict(zip(names, at.cursors))},
        "description": stream.describe(),
        "changes": list(changes),
    }


def _entries(source_fp: dict) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for k, v in source_fp.items():
        if k != "mixture":
            out.setdefault(_entry_of(k), {})[k] = v
    return out


def _what_changed(before: dict, after: dict) -> str:
    b = {e["name"]: e for e in before["entries"]}
    a = {e["name"]: e for e in after["entries"]}
    parts = [f"added {n!r}" for n in a if n not in b] + [f"removed {n!r}" for n in b if n not in a]
    for n in a:
        if n in b and a[n] != b[n]:
            fields = [f"{k} {b[n].get(k)!r} -> {a[n].get(k)!r}" for k in a[n] if a[n].get(k) != b[n].get(k)]
            parts.append(f"{n!r}: {', '.join(fields)}")
    return "; ".join(parts)


def resume_mixture(state: dict, fingerprint, stream) -> dict:
    """Set `stream`'s origin from a saved state, and return the state with its mixture fingerprint replaced by the
    current one when the mixture changed (the change recorded in the state's `changes`), so the loader's own
    checks compare everything else. `fingerprint()` gives the loader's fingerprint as the stream now stands. A
    state without a mixture part (a single source) is returned as it is."""
    saved = state.get("mixture")
    if saved is None or not hasattr(stream, "entry_of"):
        return state
    names = stream.names
    before = saved["description"]
    if stream.relative and stream.mixture.epoch_docs is None:
        stream.num_docs = int(before["epoch_docs"])  # document ids stay those of the saved epoch
        stream.source.description = stream.describe()
    old_src, new_src = state["fingerprint"]["source"], fingerprint()["source"]
    old_entries, new_entries = _entries(old_src), _entries(new_src)
    for n in names:
        if n in old_entries and old_entries[n] != new_entries[n]:
            raise MixtureError(f"mixture entry {n!r} reads other shards than when the state was saved (saved "
                               f"{sorted(old_entries[n])[:3]}, now {sorted(new_entries[n])[:3]}); resuming would lose "
                               "and repeat its documents")
    o = saved["origin"]
    pending = {}
    for doc, name, idx in o["pending"]:
        if name not in names:
            raise MixtureError(f"mixture entry {name!r} was removed, but the saved state still holds its document "
                               f"{doc} to train (queued, or begun by the step before); keep the entry (weight 0 "
                               "stops drawing from it) until the mixture epoch ends")
        pending[int(doc)] = (names.index(name), int(idx))
    after = stream.describe()
    if before == after:
        cursors = [int(o["cursors"][n]) for n in names]
        tokens = [float(o["tokens"][n]) for n in names]
        stream.set_origin(o["epoch"], o["pos"], BlendState(cursors=cursors, tokens=tokens, total=o["total"]), pending)
        return state
    if not stream.relative or any(e.get("weight") is None for e in before["entries"]):
        raise MixtureError(f"the mixture changed at resume ({_what_changed(before, after)}), but changes are supported "
                           "for weighted mixtures only (a repeat/choose epoch is its quotas)")
    if int(state["loader"]["skip"]) or any(int(p["skip"]) for p in state.get("ranks") or []):
        raise MixtureError(f"the mixture changed at resume ({_what_changed(before, after)}): that needs a state saved "
                           "at a step boundary (this one was saved inside a step)")
    if stream.mixture.epoch_docs is not None and stream.mixture.epoch_docs != before["epoch_docs"]:
        raise MixtureError(f"the mixture changed at resume with epoch_docs {stream.mixture.epoch_docs}, but the saved "
                           f"epoch holds {before['epoch_docs']} documents: a mixture epoch keeps its size")
    at = saved["at"]
    cursors = [int(at["cursors"].get(n, 0)) for n in names]
    stream.set_origin(at["epoch"], at["pos"], BlendState(cursors=cursors, tokens=[0.0] * len(names)), pending)
    what = _what_changed(before, after)
    step = None if state["loader"]["step_state"] is None else int(state["loader"]["step_state"]["k"])
    change = {"step": step, "epoch": at["epoch"], "pos": at["pos"], "what": what, "before": before, "after": after}
    log.warning("packloader: the mixture changed at resume, from step %s (mixture epoch %s, position %s): %s",
                step, at["epoch"], at["pos"], what)
    fp = msgspec.json.decode(msgspec.json.encode(state["fingerprint"]))
    now = fingerprint()
    fp["source"], fp["num_docs"] = now["source"], now["num_docs"]
    out = dict(state, fingerprint=fp, mixture=dict(saved, changes=[*saved["changes"], change]))
    return out

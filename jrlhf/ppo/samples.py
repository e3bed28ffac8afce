"""The sample channel: generated batches and the update's results between process groups.

With generation and training on different processes (asynchronous RL), the generating side sends
each batch it generates to the training side, and the training side sends back what the
generating side needs of each update (its metrics, for the logs process 0 writes, and the KL
coefficient).

Two planes, as in the systems this follows:

* data plane: a batch (token ids, behaviour log-probs, per-token policy versions, prompts, meta)
  is packed into one byte array (:func:`pack_batch`: rows one after the other, without padding)
  on a device of the sender and moved to a device of every receiving process with JAX's
  cross-host transfer (``jax.device_put`` to a one-device twin sharding; the sender and that
  receiver make the call, the sender first and without waiting). The sender keeps the source
  buffer until the receivers have certainly read it (:meth:`SampleChannel.release_through`,
  after the update that trained on it).
* control plane: JAX's coordination service carries a small header per batch (its index and
  the byte layout, whatever the batch size) and the per-iteration result. Every key is read once
  by its one reader and deleted then, so the service holds only messages in flight.

``data_bytes`` and ``control_bytes`` count what this process sent and received, per iteration
(:meth:`SampleChannel.counts`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jrlhf.meshes.processes import post, take
from jrlhf.ppo.staleness import GeneratedBatch


def _ragged(rows: Sequence[Sequence[Any]], dtype) -> tuple[np.ndarray, np.ndarray]:
    """Rows of different lengths as one flat array (the rows one after the other, no padding:
    a long-tailed batch's rows would mostly be padding) and the lengths."""
    lengths = np.asarray([len(r) for r in rows], np.int32)
    if not len(rows):
        return np.zeros(0, dtype), lengths
    return np.concatenate([np.asarray(r, dtype).reshape(-1) for r in rows]), lengths


def _unragged(values: np.ndarray, lengths: np.ndarray) -> list[np.ndarray]:
    return np.split(values, np.cumsum(lengths)[:-1]) if len(lengths) else []


def pack_batch(batch: GeneratedBatch) -> tuple[dict[str, Any], np.ndarray]:
    """A batch as (header, bytes): every field in one uint8 array, the header says where."""
    completions, lengths = _ragged(batch.completions, np.int32)
    fields = {
        "completions": completions,
        "lengths": lengths,
        "raw_logprobs": _ragged(batch.raw_logprobs, np.float32)[0],
        "token_versions": _ragged(batch.token_versions, np.int64)[0],
        "prompt_index": np.asarray(batch.prompt_index, np.int32),
    }
    fields["prompts"], fields["prompt_lengths"] = _ragged(batch.prompts, np.int32)
    if batch.finished is not None:
        fields["finished"] = np.asarray(batch.finished, np.uint8)
    if batch.passes is not None:
        fields["passes"] = np.asarray(batch.passes, np.int32)
    if batch.meta is not None:
        fields["meta"] = np.frombuffer(json.dumps([dict(m) for m in batch.meta]).encode(), np.uint8)
    if batch.policy_masks is not None:  # multi-turn: the policy's tokens, the episodes' records
        fields["policy_masks"] = _ragged(batch.policy_masks, np.uint8)[0]
    for name, values in (batch.episodes or {}).items():
        fields[f"episode/{name}"] = np.asarray(values, np.float64)
    layout, parts, offset = [], [], 0
    for name, a in fields.items():
        raw = np.ascontiguousarray(a).view(np.uint8).reshape(-1)
        layout.append([name, a.dtype.str, list(a.shape), offset])
        parts.append(raw)
        offset += raw.size
    header = {"index": batch.index, "round": batch.round, "layout": layout, "bytes": offset}
    return header, np.concatenate(parts)


def unpack_batch(header: dict[str, Any], data: np.ndarray) -> GeneratedBatch:
    """The inverse of :func:`pack_batch`."""
    f = {}
    for name, dtype, shape, offset in header["layout"]:
        dt = np.dtype(dtype)
        n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        f[name] = data[offset : offset + n].view(dt).reshape(shape)
    lengths = f["lengths"]
    meta = json.loads(f["meta"].tobytes()) if "meta" in f else None
    return GeneratedBatch(
        index=int(header["index"]),
        prompts=[p.tolist() for p in _unragged(f["prompts"], f["prompt_lengths"])],
        meta=meta,
        prompt_index=f["prompt_index"].astype(np.int64),
        completions=[c.tolist() for c in _unragged(f["completions"], lengths)],
        raw_logprobs=[x.copy() for x in _unragged(f["raw_logprobs"], lengths)],
        token_versions=[v.copy() for v in _unragged(f["token_versions"], lengths)],
        finished=None if "finished" not in f else [bool(x) for x in f["finished"]],
        passes=None if "passes" not in f else [int(x) for x in f["passes"]],
        round=int(header.get("round", 0)),
        policy_masks=(
            None
            if "policy_masks" not in f
            else [m.astype(bool) for m in _unragged(f["policy_masks"], lengths)]
        ),
        episodes={k[8:]: v.copy() for k, v in f.items() if k.startswith("episode/")} or None,
    )


def _on(device: jax.Device) -> NamedSharding:
    return NamedSharding(Mesh(np.array([device]), ("one",)), PartitionSpec())


class SampleChannel:
    """Messages of one asynchronous run between the generating and the training group.

    ``source``: the generating group's device that stages a batch (its process sends for the
    group, whose processes all hold the same batches); ``sinks``: one device of each process of
    the training group, each of which receives every batch. Results go from the training
    group's first process to every process of ``readers`` (the generating group). Every process
    constructs the same channel and calls its side's methods.

    JAX pairs cross-host transfers by their order on each process (the n-th call of the
    sender with the n-th call of the receiver), so every process makes every transfer call, in
    one order for the whole job: the generating group when it sends the rounds of an iteration
    (:meth:`send`), the training group when it receives them (:meth:`receive_next`: those of
    the batch it trains on first, the rest before the weights of that iteration move), each
    between the same two weight transfers.
    """

    def __init__(
        self,
        source: jax.Device,
        sinks: Sequence[jax.Device],
        readers: Sequence[int],
        prefix: str = "async",
    ):
        self.source, self.sinks, self.prefix = source, list(sinks), prefix
        self.result_readers = list(readers)  # the generating group's processes
        # staged rounds, by (batch, round), not yet known to be read
        self.sent: dict[tuple[int, int], jax.Array] = {}
        self.announced: dict[str, list[dict[str, Any]]] = {}  # per tag, not yet received
        self.data_bytes = 0
        self.control_bytes = 0

    def counts(self) -> dict[str, float]:
        """The bytes this process moved through each plane since the last call."""
        out = {"samples/data_bytes": float(self.data_bytes)}
        out["samples/control_bytes"] = float(self.control_bytes)
        self.data_bytes = self.control_bytes = 0
        return out

    def _post(self, key: str, value: Any) -> None:
        data = json.dumps(value).encode()
        self.control_bytes += len(data)
        post(f"{self.prefix}/{key}", data)

    def _take(self, key: str) -> Any:
        data = take(f"{self.prefix}/{key}")
        self.control_bytes += len(data)
        return json.loads(data)

    def _transfer(self, staged: jax.Array) -> list[jax.Array]:
        """The calls that move ``staged`` to every sink (every process makes them)."""
        return [jax.device_put(staged, _on(sink)) for sink in self.sinks]

    def _placeholder(self, nbytes: int) -> jax.Array:
        """The staged array as a process other than the source sees it: no local data."""
        return jax.make_array_from_single_device_arrays(
            (nbytes,), _on(self.source), [], dtype=np.uint8
        )

    # -- batches: the generating group -> the training group --------------------------------------
    def send(self, tag: str, batches: Sequence[GeneratedBatch]) -> None:
        """Generating group: stage the rounds generated under ``tag`` (an iteration, or an
        iteration's extra round) for every receiver and announce them; returns at once (the
        receivers pull them when they need them)."""
        headers = []
        for batch in batches:
            header, data = pack_batch(batch)
            headers.append(header)
            if jax.process_index() == self.source.process_index:
                staged = jax.device_put(data, _on(self.source))
                self.sent[(batch.index, batch.round)] = staged
                self.data_bytes += data.size * len(self.sinks)
            else:  # the group's other processes hold the same batch; the source sends it
                staged = self._placeholder(data.size)
            self._transfer(staged)
        if jax.process_index() == self.source.process_index:
            for sink in self.sinks:  # one message per reader, so each deletes its own
                self._post(f"sent/{tag}/{sink.process_index}", headers)

    def _announcement(self, tag: str) -> list[dict[str, Any]]:
        if tag not in self.announced:
            self.announced[tag] = self._take(f"sent/{tag}/{jax.process_index()}")
        return self.announced[tag]

    def receive_next(self, tag: str) -> GeneratedBatch | None:
        """Training group: the next round sent under ``tag`` (waiting for it), None when every
        round sent under it has been received."""
        left = self._announcement(tag)
        if not left:
            return None
        header = left.pop(0)
        outs = self._transfer(self._placeholder(int(header["bytes"])))
        me = jax.process_index()
        for sink, out in zip(self.sinks, outs):
            if sink.process_index == me:
                data = np.asarray(out.addressable_data(0))
                self.data_bytes += data.size
                return unpack_batch(header, data)
        raise AssertionError(f"process {me} is not a receiver of the sample channel")

    def receive_all(self, tag: str) -> list[GeneratedBatch]:
        """Training group: every round sent under ``tag`` not yet received, in order."""
        out = []
        while (batch := self.receive_next(tag)) is not None:
            out.append(batch)
        return out

    def forget_through(self, iteration: int) -> None:
        """Training group: drop the bookkeeping of tags of iterations up to ``iteration``."""
        for tag in [t for t in self.announced if int(t.split(".")[0]) <= iteration]:
            if self.announced[tag]:
                raise AssertionError(f"rounds sent under {tag} were never received")
            del self.announced[tag]

    def release_through(self, index: int) -> None:
        """Sender: free the staged rounds of batches up to ``index`` (every receiver has read
        them: it trained on them before the weights of that update were sent)."""
        for key in [key for key in self.sent if key[0] <= index]:
            self.sent.pop(key).delete()

    # -- dynamic sampling's last chances: the training group asks for one more round -----------
    def ask(self, iteration: int, step: int, more: bool) -> None:
        """Training group: whether the generating group must generate another round of batch
        ``iteration`` before its weights move (``step``: how many it generated so far)."""
        if jax.process_index() != min(s.process_index for s in self.sinks):
            return
        for reader in self.result_readers:
            self._post(f"more/{iteration}/{step}/{reader}", bool(more))

    def asked(self, iteration: int, step: int) -> bool:
        """Generating group: what :meth:`ask` said for ``iteration`` after ``step`` rounds."""
        return bool(self._take(f"more/{iteration}/{step}/{jax.process_index()}"))

    # -- results: a receiver -> the sender -------------------------------------------------------
    def send_result(self, iteration: int, result: dict[str, float]) -> None:
        """Training group: iteration ``iteration``'s metrics (and the KL coefficient after it),
        sent by its first process to every process of the generating group."""
        if jax.process_index() != min(s.process_index for s in self.sinks):
            return
        for reader in self.result_readers:
            self._post(f"result/{iteration}/{reader}", result)

    def receive_result(self, iteration: int) -> dict[str, float]:
        """Generating group: what :meth:`send_result` sent for ``iteration``."""
        return self._take(f"result/{iteration}/{jax.process_index()}")

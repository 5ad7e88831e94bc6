"""The trainer's commit record in Redis and the exactly-once invariant.

State lives in three places: the weights (in memory, published to workers, and in a
checkpoint on disk every K steps), the commit record ``keys.TRAINER_OFFSET`` (step, version,
epoch, and per sample-log partition the seq/id of its last trained sample) and the ledger ``keys.TRAINER_TRAINED`` (step ->
ids trained in that step). Order per optimizer step on rank 0:

    optimizer.step()  ->  commit(offset + ledger, one atomic write)  ->  publish(version+1)
                      ->  checkpoint (every K steps; written after its commit)

With ``redis.wait_replicas`` a commit counts only once that many replicas confirm it (WAIT on
the connection that wrote it): a failover right after an unconfirmed commit could roll the
record back, and the samples it names would be handed out and trained again. The leader holds
further steps and the step's publish until the commit is confirmed (services/trainer/leader.py).

Invariant: *the ledger lists exactly the samples whose gradient is in the weights of the
current lineage*, and the checkpoint is never ahead of the commit record. A kill -9 loses
the in-memory weights of steps after the last checkpoint; those steps' effect is gone, so on
restart :func:`rollback` atomically deletes their ledger entries and moves the offset back
to the checkpoint's, and the trainer replays them from the log. Each sample id therefore
ends up in the ledger — and in the weights — exactly once. Versions stay monotonic across
the rollback (``max(checkpoint, commit record, keys.MODEL_VERSION, version floor) + 1``; the floor,
kept on disk, holds when Redis lost the other two: services/trainer/version_floor.py), and the restored
weights are published at once as that new version, so workers that served the lost
lineage move to the surviving one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from redis import Redis, RedisCluster
from redis.exceptions import RedisError, WatchError
from redis.typing import EncodableT, FieldT

from shared import keys
from shared.config import RedisConfig
from shared.redis_client import check_replicas
from shared.samples import position_field
from shared.text import as_str

VERSION_SEQS_KEPT = 4096

# The commit as one script (atomic like the MULTI it stands for), so that WAIT can follow it on
# the same connection: WAIT counts the replicas that hold that connection's writes.
# KEYS: offset, trained, skipped; ARGV: step, trained ids, skipped ids ("" for none), offset fields.
_COMMIT_LUA = """
redis.call('HSET', KEYS[1], unpack(ARGV, 4))
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
if ARGV[3] ~= '' then redis.call('HSET', KEYS[3], ARGV[1], ARGV[3]) end
return 1
"""


@dataclass
class Position:
    """Where the trainer stands in one partition of the sample log."""

    seq: int = 0  # last trained
    id: str = ""  # its log entry
    log: str = ""  # keys.sample_log_id of the log that seq and id belong to ("" before any sample)


@dataclass
class Offset:
    """The commit record: the step, version and epoch, and a position per sample-log partition
    (a partition not listed: nothing trained from it yet)."""

    step: int = 0
    version: int = 0
    epoch: int = 0
    positions: dict[int, Position] = field(default_factory=dict)

    def at(self, partition: int) -> Position:
        return self.positions.get(partition, Position())

    @property
    def seq(self) -> int:
        """Samples trained over every partition (each partition's seq is dense from 1)."""
        return sum(p.seq for p in self.positions.values())

    def fields(self) -> dict[FieldT, EncodableT]:
        out: dict[FieldT, EncodableT] = {"step": self.step, "version": self.version, "epoch": self.epoch}
        for part, pos in {0: self.at(0), **self.positions}.items():
            out |= {position_field("seq", part): pos.seq, position_field("id", part): pos.id,
                    position_field("log", part): pos.log}
        return out


def read_offset(redis: Any) -> Offset:
    raw = {as_str(k): as_str(v) for k, v in (redis.hgetall(keys.TRAINER_OFFSET) or {}).items()}
    positions: dict[int, Position] = {}
    for name, value in raw.items():
        base, _, part = name.partition(".")
        if base == "seq" and (part == "" or part.isdigit()):
            p = int(part or 0)
            positions[p] = Position(int(value), raw.get(position_field("id", p), ""),
                                    raw.get(position_field("log", p), ""))
    return Offset(int(raw.get("step", 0)), int(raw.get("version", 0)), int(raw.get("epoch", 0)), positions)


class Ledger:
    """Rank 0's writes to the commit record, the ledger and the read-your-writes marks."""

    def __init__(self, redis: Redis, partitions: int = 1, redis_cfg: RedisConfig | None = None) -> None:
        self.redis = redis
        self.partitions = partitions
        self._confirm = redis_cfg if redis_cfg is not None and redis_cfg.wait_replicas else None

    def resume(self, checkpointed: Offset, version_floor: int = 0) -> tuple[Offset, int]:
        """Make Redis agree with the checkpoint: drop ledger steps after it, reset the offset,
        bump the epoch; the new version is above ``version_floor`` too. Returns (the new offset,
        how many steps were rolled back)."""
        new, rolled = _rollback(self.redis, checkpointed, version_floor)
        # versions of the lost steps no longer hold the samples after the checkpoint's position
        pipe = self.redis.pipeline(transaction=False)
        for part in range(self.partitions):
            if new.at(part).log:
                pipe.zremrangebyscore(keys.model_version_seq(part, new.at(part).log), f"({new.at(part).seq}", "+inf")
        pipe.execute()
        return new, rolled

    def commit(self, off: Offset, ids: list[str], skipped: dict[str, str] | None = None) -> None:
        """Record one optimizer step atomically: the offset, the ids whose gradient the step holds,
        and the ids it consumed without one (``skipped``: id -> reason), kept apart. With
        ``redis.wait_replicas`` raises :class:`~shared.redis_client.ReplicasBehind` when fewer
        replicas confirm it in time: the record is then on the master but not safe; committing
        the same step again (it writes the same values) is how to confirm it later."""
        if self._confirm is not None:
            self._commit_confirmed(self._confirm, off, ids, skipped or {})
            return
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(keys.TRAINER_OFFSET, mapping=off.fields())
        pipe.hset(keys.TRAINER_TRAINED, str(off.step), " ".join(ids))
        if skipped:
            pipe.hset(keys.TRAINER_SKIPPED, str(off.step), " ".join(f"{i}={r}" for i, r in skipped.items()))
        pipe.execute()

    def _commit_confirmed(self, cfg: RedisConfig, off: Offset, ids: list[str], skipped: dict[str, str]) -> None:
        node: Redis = self.redis
        if isinstance(self.redis, RedisCluster):  # the {trainer} slot's master, one connection
            node = self.redis.get_redis_connection(self.redis.get_node_from_key(keys.TRAINER_OFFSET))
        fields = [x for pair in off.fields().items() for x in pair]
        pipe = node.pipeline(transaction=False)
        pipe.eval(_COMMIT_LUA, 3, keys.TRAINER_OFFSET, keys.TRAINER_TRAINED, keys.TRAINER_SKIPPED, str(off.step),
                  " ".join(ids), " ".join(f"{i}={r}" for i, r in skipped.items()), *fields)
        pipe.execute_command("WAIT", cfg.wait_replicas, cfg.wait_timeout_ms)
        try:
            _, acked = pipe.execute()
        except RedisError:
            if isinstance(self.redis, RedisCluster):  # a failover moved the slot: read the map again
                self.redis.nodes_manager.initialize()
            raise
        check_replicas(cfg, int(acked))

    def record_offset(self, off: Offset) -> None:
        """The commit record alone (a position moved without a step: a new sample log). Not
        confirmed with WAIT: a failover that loses it leaves the record naming the old log, which
        the trainer tells from the new one again at its next read and records the same position;
        the next step's commit, which is confirmed, carries it too."""
        self.redis.hset(keys.TRAINER_OFFSET, mapping=off.fields())

    def record_version_seq(self, version: int, seqs: dict[int, int], off: Offset) -> None:
        """keys.model_version_seq: ``version`` holds every pass over the samples of each partition
        up to its seq in ``seqs``, in the log ``off`` names for it (read-your-writes for ``learn``)."""
        pipe = self.redis.pipeline(transaction=False)
        for part, seq in seqs.items():
            log_id = off.at(part).log
            if log_id:
                pipe.zadd(keys.model_version_seq(part, log_id), {str(version): seq})
                pipe.zremrangebyrank(keys.model_version_seq(part, log_id), 0, -VERSION_SEQS_KEPT - 1)
        pipe.execute()

    def trim_log(self, off: Offset, current: Offset) -> None:
        """Replay after a crash starts at a kept checkpoint's entries, at the earliest at those of
        ``off`` (the oldest kept): older entries are never read again. A partition whose log
        changed since ``off`` (``current`` names another one) is left whole."""
        pipe = self.redis.pipeline(transaction=False)
        for part, pos in off.positions.items():
            if pos.id and pos.log == current.at(part).log:
                pipe.xtrim(keys.sample_log(part), minid=pos.id, approximate=False)
        pipe.execute()


def _rollback(redis: Any, to: Offset, version_floor: int) -> tuple[Offset, int]:
    while True:
        # read before WATCH: keys.MODEL_VERSION is in another slot than the {trainer} keys, and
        # only the trainer (this process) writes it
        published = _published_version(redis)
        with redis.pipeline(transaction=True) as pipe:
            try:
                pipe.watch(keys.TRAINER_OFFSET, keys.TRAINER_TRAINED, keys.TRAINER_SKIPPED)
                current = read_offset(pipe)
                later = [f for f in pipe.hkeys(keys.TRAINER_TRAINED) if int(as_str(f)) > to.step]
                later_skipped = [f for f in pipe.hkeys(keys.TRAINER_SKIPPED) if int(as_str(f)) > to.step]
                # +1: the restored weights are published as a version nobody has served yet
                version = max(current.version, to.version, published, version_floor) + 1
                new = Offset(to.step, version, current.epoch + 1, dict(to.positions))
                pipe.multi()
                pipe.delete(keys.TRAINER_OFFSET)  # partitions first read after the checkpoint start over
                if later:
                    pipe.hdel(keys.TRAINER_TRAINED, *later)
                if later_skipped:
                    pipe.hdel(keys.TRAINER_SKIPPED, *later_skipped)
                pipe.hset(keys.TRAINER_OFFSET, mapping=new.fields())
                pipe.execute()
                return new, len(later)
            except WatchError:
                continue


def _published_version(redis: Any) -> int:
    """keys.MODEL_VERSION as written by the publisher (0 when absent or not a plain integer)."""
    try:
        return int(redis.get(keys.MODEL_VERSION) or 0)
    except Exception:
        return 0


def skipped_ids(redis: Any) -> dict[str, str]:
    """Every id consumed without a gradient -> the reason (tests, audits, admin stats)."""
    out: dict[str, str] = {}
    for v in (redis.hgetall(keys.TRAINER_SKIPPED) or {}).values():
        for item in as_str(v).split():
            sid, _, reason = item.rpartition("=")
            out[sid] = reason
    return out


def trained_ids(redis: Any) -> list[str]:
    """Every id in the ledger, with repetitions (tests and audits count them)."""
    out: list[str] = []
    for v in (redis.hgetall(keys.TRAINER_TRAINED) or {}).values():
        out.extend(as_str(v).split())
    return out

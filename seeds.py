"""Every random stream of a run comes from one function of named keys.

    seeds.seed(cfg.train.seed, "sample", step, round_)   # step s's sampling, DAPO refill round k
    seeds.seed(batch_seed, "turn", t)                    # turn t of a multi-turn batch
    seeds.seed(turn_seed, "request", k)                  # the k-th request sent to vLLM

A stream is named, not computed: seeds mixed by hand (seed * 100_003 + step, then + k per request)
let two streams coincide, as request k of step s and request k - 1 of step s + 1 once did. A hash of
the whole key cannot collide by arithmetic, and a resumed run recomputes every stream from
(seed, step) alone.
"""
import hashlib


def seed(*keys) -> int:
    """A 63-bit seed for the stream the keys name (ints and strings, in order): BLAKE2b of their
    text, so distinct keys give unrelated seeds on every machine and Python version. Fits torch,
    random and vLLM alike."""
    text = repr(tuple(k if isinstance(k, str) else int(k) for k in keys))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1

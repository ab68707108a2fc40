"""Limits the engine and every front end (the CLI, the Python API, the server, `bench`) share.
Imports nothing, so the lowest module can use it."""

MAX_K = 64  # the longest draft one step may propose: --k, --kmax and a configuration's k
DEFAULT_KMAX = 8  # the most the controller may draft under k = "auto" (--kmax's default)
MAX_TREE_NODES = 128  # the most nodes of one token-tree draft (Drafter.max_nodes)
# the `suffix` drafter's store of earlier requests: its default caps, and whose text a request
# drafts from on the server (the default first: per user)
SUFFIX_STORE_MIB, SUFFIX_STORE_REQUESTS = 64.0, 10_000
SUFFIX_STORE_MIN_MIB = 1 / 64  # 16 KiB: an empty store's arrays, dicts and deque fit under it
SUFFIX_ISOLATION = ("user", "shared")
K_RANGE = f"1..{MAX_K}"  # as error messages and help texts write it
RULES = ("invariant", "residual")  # how sampled drafts are verified (SamplingParams.rule)
MIN_SEED, MAX_SEED = -(2**63), 2**64 - 1  # any signed or unsigned 64-bit seed (noise: mod 2**64)
# the sampled audit states its sample size by the TV distance it detects with AUDIT_POWER; a
# real audit detects AUDIT_REAL_TV (the bench's default one is a smoke check: far larger)
AUDIT_POWER, AUDIT_REAL_TV = 0.99, 0.1


def valid_k(value: object) -> bool:
    """An integer (not a bool) in 1..MAX_K."""
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_K

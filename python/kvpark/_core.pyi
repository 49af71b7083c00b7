"""kvpark's KV cell pool, page tables, occupancy queries and preemption planner (kvpark-core).

Hand-written to mirror rust/py/; `python -m mypy.stubtest kvpark._core` checks the two agree.
"""

from typing import Literal, TypedDict, final

__all__ = [
    "Action",
    "KvPool",
    "Planner",
    "PoolFullError",
    "RequestView",
    "_CpuDecoder",
    "_blockmm_q4",
    "_blockmm_q4_i8",
    "_blockmm_q6",
    "_blockmm_q6_i8",
    "_blockmm_q8",
    "_blockmm_q8_i8",
    "_cpu_features",
    "_cpu_pack_q4",
    "_cpu_pack_q5",
    "_cpu_pack_q5_blocks",
    "_cpu_pack_q6",
    "_cpu_set_threads",
    "_decode_attention",
    "_rms_norm",
    "round_up_buffer",
]

class PoolFullError(Exception):
    """Not enough free pages in the pool; the call changed nothing.

    The message says how many pages were needed and how many are free.
    """

@final
class KvPool:
    """The KV cell pool: pages of `page_size` cells with ref counts, and each sequence's page table.

    Sequence ids are ints >= 0 chosen by the caller; page ids are 0..n_pages; the cell of page p
    at offset o has the flat index p * page_size + o. Free pages are handed out LIFO: a fresh
    pool gives 0, 1, 2, ...; a released page is the next one given. Every failing call changes
    nothing. Unknown sequence: KeyError; too few free pages: PoolFullError; other bad
    arguments: ValueError.

    With prefix_cache_salt set, full pages whose token ids were registered stay cached when
    released (held by no sequence, findable by the hash chain of their tokens) until their room
    is needed; see register_tokens, match_prefix and docs/preemption.md.
    """

    def __new__(
        cls,
        n_cells: int,
        page_size: int = 16,
        prefix_cache_salt: int | None = None,
        window: int | None = None,
    ) -> KvPool:
        """ValueError unless page_size > 0, n_cells > 0 and n_cells is a multiple of page_size.

        prefix_cache_salt (0..2**64): turn the prefix cache on, under this salt (it stands for
        the model, dtype and exact-mode tiling: pages are found only under the same salt).
        window: every sequence's rows attend over their last `window` positions only, so a
        prefix hit needs only the pages of the window before it (set_window).
        """

    @property
    def prefix_cache_salt(self) -> int | None:
        """The prefix cache's salt; None when it is off."""

    @property
    def window(self) -> int | None:
        """The window the pool's sequences slide over; None where they attend to everything."""

    @property
    def page_size(self) -> int:
        """Cells per page."""

    @property
    def n_pages(self) -> int:
        """Pages in the pool."""

    @property
    def n_cells(self) -> int:
        """Cells in the pool."""

    def add_sequence(self, seq_id: int, cache_salt: int = 0) -> None:
        """Add a sequence holding no cell. ValueError if it exists.

        With a nonzero cache_salt (a u64) its pages are found only by sequences of the same
        salt, and it finds only theirs: requests share cached pages only within one salt.
        """

    def has_sequence(self, seq_id: int) -> bool:
        """Whether the sequence exists."""

    def sequences(self) -> list[int]:
        """Every sequence id, ascending."""

    def seq_len(self, seq_id: int) -> int:
        """Cells (tokens) the sequence spans, released ones included."""

    def released_cells(self, seq_id: int) -> int:
        """Cells at the start of the sequence it released (release_before): whole pages."""

    def release_before(self, seq_id: int, pos: int) -> int:
        """Gives back the sequence's pages wholly before position pos (behind every layer's
        sliding window); returns the cells that went back to the pool. On an empty sequence its
        length becomes pos rounded down to a page, all released. ValueError past the end."""

    def page_table(self, seq_id: int) -> list[int]:
        """The sequence's pages in logical order: those it holds, after any it released."""

    def pages_needed(self, seq_id: int, n_tokens: int) -> int:
        """Extra pages the sequence needs to hold n_tokens cells in all (0 if it does already)."""

    def reserve(self, seq_id: int, n_tokens: int) -> list[int]:
        """Grow the sequence to hold n_tokens cells in all; return the new page ids.

        All or nothing: PoolFullError changes nothing. ValueError if n_tokens < seq_len.
        """

    def truncate(self, seq_id: int, n_tokens: int) -> list[tuple[int, int]]:
        """Keep the first n_tokens cells; release the pages no longer needed.

        A partly used new tail page shared with another sequence is replaced by a private copy:
        returns [(src_page, dst_page)], the page copy the runner must do, else [].
        PoolFullError (nothing changed) if no page is left for the copy; ValueError if
        n_tokens > seq_len.
        """

    def fork(self, parent: int, child: int) -> list[tuple[int, int]]:
        """Add sequence child sharing parent's full pages (ref counts +1).

        A partly used last page is not shared: the child gets a fresh page and the call returns
        [(src_page, dst_page)], the page copy the runner must do, else []. KeyError if parent is
        unknown, ValueError if child exists, PoolFullError (nothing changed) if no page is free.
        """

    def free_sequence(self, seq_id: int) -> int:
        """Remove the sequence; return the cells that went back to the pool."""

    def slot_mapping(self, seq_id: int, start: int, count: int) -> list[int]:
        """Flat cell indices page * page_size + offset of logical positions start..start+count.

        ValueError if start + count > seq_len.
        """

    def export_step(
        self, seq_ids: list[int], starts: list[int], counts: list[int]
    ) -> tuple[list[int], list[list[int]]]:
        """One call per step: (concatenated slot mappings of every item, each item's page table
        over all its logical pages, -1 for each released one).

        Errors as slot_mapping; ValueError if the three lists differ in length.
        """

    def cells_used(self) -> int:
        """Cells in pages held by at least one sequence.

        A shared cell counts once, a partly used page in full.
        """

    def cells_free(self) -> int:
        """Cells an allocation can take: free pages plus cached ones (evicted when needed)."""

    def cells_freed_by(self, seq_ids: list[int]) -> int:
        """Cells that removing exactly these sequences would free.

        A sequence given twice counts once; KeyError for an unknown one.
        """

    def can_fit(self, n_cells: int) -> bool:
        """Whether n_cells more cells, rounded up to whole pages, fit in free and cached pages."""

    def cells_cached(self) -> int:
        """Cells in cached pages: held by no sequence, findable until evicted.

        Part of cells_free; 0 with the prefix cache off.
        """

    def register_tokens(self, seq_id: int, tokens: list[int]) -> int:
        """Tell the pool the token ids of the sequence's next cells.

        Call once a step has written their K and V (prompt and decoded rows alike); every page
        this fills is registered. Returns the pages newly registered. ValueError (nothing
        changed) if the registered tokens would pass seq_len. With the prefix cache off: checks
        the same, registers nothing.
        """

    def register_step(self, seq_ids: list[int], tokens: list[list[int]]) -> int:
        """register_tokens for every (seq_ids[i], tokens[i]) in order, in one call per step.

        All or nothing. ValueError if the lists differ in length.
        """

    def registered_len(self, seq_id: int) -> int:
        """Tokens of the sequence registered so far (0 with the prefix cache off)."""

    def cached_prefix(
        self, tokens: list[int], max_tokens: int, cache_salt: int = 0
    ) -> tuple[int, int]:
        """Pure: (tokens covered, cached cells) of the longest cached prefix of tokens[:max_tokens].

        Whole registered pages of cache_salt only. Cached cells: those of the hit held by no
        sequence now, which cost room when taken.
        """

    def cells_to_admit(
        self, tokens: list[int], max_tokens: int, n_cells: int, cache_salt: int = 0
    ) -> int:
        """Pure: the room a new sequence holding n_cells cells takes after its cached prefix.

        Free or cached cells: its pages beyond the hit of tokens[:max_tokens] (among the pages
        of cache_salt) plus the hit's pages that are cached now. For the admission check
        against cells_free() and a parked request's resume_cells.
        """

    def match_prefix(self, seq_id: int, tokens: list[int], max_tokens: int) -> int:
        """Attach to the empty sequence the longest cached prefix of tokens[:max_tokens].

        Whole registered pages join its page table (a cached page leaves the cache); returns
        the tokens covered, its new seq_len (0: no hit). Takes no free page. Pass max_tokens =
        len(prompt) - 1 for a prompt, the computed count for a swap resume. Only pages of the
        sequence's own cache_salt are found. ValueError if the sequence holds cells; 0 with the
        cache off.
        """

    def page_key(self, page: int) -> int | None:
        """The page's key in the hash chain if it is registered (held or cached), else None.

        ValueError if not in 0..n_pages.
        """

    def eviction_order(self) -> list[int]:
        """The cached pages in the order eviction would take them (LRU leaf first).

        O(cached); for tests and debugging.
        """

    def page_refcount(self, page: int) -> int:
        """How many page tables hold the page (0: free). ValueError if not in 0..n_pages."""

    def check_integrity(self) -> None:
        """Check every invariant of the pool in O(pool); RuntimeError naming the broken one."""

    def reset(self) -> None:
        """Drop every sequence and cached page; the pool is then as if new (the cache stays on)."""

@final
class RequestView:
    """One request in the planner's snapshot (keyword arguments only; read-only fields).

    state: "running" | "parked" | "parking" | "restoring"; mode ("swap" | "recompute") is given
    exactly when state is "parked". next_cells: per sequence, the cells it would hold after the
    next step (running, restoring). resume_cells: cells a parked request needs to come back and
    run one step. state_bytes: what a swap park of it holds. ValueError on a bad state or mode.
    """

    def __new__(
        cls,
        *,
        id: int,
        arrival: int,
        state: Literal["running", "parked", "parking", "restoring"] = "running",
        mode: Literal["swap", "recompute"] | None = None,
        seq_ids: list[int] = ...,
        next_cells: list[tuple[int, int]] = ...,
        resume_cells: int = 0,
        state_bytes: int = 0,
        parks: int = 0,
        parked_at_ms: int | None = None,
        resumed_at_ms: int | None = None,
        tokens_since_resume: int = 0,
        family: bool = False,
        refused: bool = False,
        slot: int = 0,
    ) -> RequestView: ...
    @property
    def id(self) -> int: ...
    @property
    def arrival(self) -> int: ...
    @property
    def state(self) -> Literal["running", "parked", "parking", "restoring"]:
        """ "running" | "parked" | "parking" | "restoring"."""

    @property
    def mode(self) -> Literal["swap", "recompute"] | None:
        """ "swap" | "recompute" for a parked request, else None."""

    @property
    def seq_ids(self) -> list[int]: ...
    @property
    def next_cells(self) -> list[tuple[int, int]]: ...
    @property
    def resume_cells(self) -> int: ...
    @property
    def state_bytes(self) -> int: ...
    @property
    def parks(self) -> int: ...
    @property
    def parked_at_ms(self) -> int | None: ...
    @property
    def resumed_at_ms(self) -> int | None: ...
    @property
    def tokens_since_resume(self) -> int: ...
    @property
    def family(self) -> bool: ...
    @property
    def refused(self) -> bool: ...
    @property
    def slot(self) -> int: ...

@final
class Action:
    """One planner action (read-only), in list order.

    kind "release_buffer": give slot's idle park buffer back (request None). "park": park
    request by mode into a buffer of buffer_capacity bytes (0 for recompute); head is set when
    the park makes room for that parked request, which a later "rotate" resumes. "resume": put
    request back. "rotate": park request (the victim) as "park" would, then resume head.
    "fail": request can never fit: fail it with the context error.
    """

    @property
    def kind(self) -> Literal["release_buffer", "park", "resume", "rotate", "fail"]:
        """ "release_buffer" | "park" | "resume" | "rotate" | "fail"."""

    @property
    def request(self) -> int | None:
        """The request it acts on (the victim for "rotate"); None for "release_buffer"."""

    @property
    def mode(self) -> Literal["swap", "recompute"] | None:
        """ "swap" | "recompute" for "park" and "rotate", else None."""

    @property
    def buffer_capacity(self) -> int:
        """Bytes of the park buffer to use for a swap; 0 otherwise."""

    @property
    def slot(self) -> int | None:
        """The slot whose buffer "release_buffer" gives back, else None."""

    @property
    def head(self) -> int | None:
        """The parked request a "rotate" (or a rotation "park") makes room for, else None."""

@final
class Planner:
    """The preemption planner: pure and deterministic, it reads the pool's occupancy and a
    snapshot of the requests and returns the actions for this step (see docs/preemption.md).

    policy: "fcfs" | "cost". margin_cells: headroom kept free, rounded up to a page.
    ram_budget_bytes: --preempt-ram in bytes, -1 no limit, 0 every park recomputes. A parked
    head that has waited rotate_after_ms rotates a resident out; a resumed request is protected
    until rotate_min_tokens tokens, or one token and rotate_min_ms. A request parked
    starved_parks times is passed over while another candidate exists. park_ahead=False
    (KVPARK_PREEMPT_PLANNER=off): plan() parks nothing for pressure; choose_victims() does it
    after a failed allocation. ValueError on a bad policy or budget.
    """

    def __new__(
        cls,
        policy: Literal["fcfs", "cost"] = "fcfs",
        margin_cells: int = 8,
        ram_budget_bytes: int = -1,
        rotate_after_ms: int = 2000,
        rotate_min_tokens: int = 32,
        rotate_min_ms: int = 2000,
        starved_parks: int = 3,
        park_ahead: bool = True,
    ) -> Planner: ...
    @property
    def policy(self) -> Literal["fcfs", "cost"]:
        """ "fcfs" | "cost"."""

    @property
    def margin_cells(self) -> int: ...
    @property
    def ram_budget_bytes(self) -> int:
        """-1: no limit."""

    @property
    def rotate_after_ms(self) -> int: ...
    @property
    def rotate_min_tokens(self) -> int: ...
    @property
    def rotate_min_ms(self) -> int: ...
    @property
    def starved_parks(self) -> int: ...
    @property
    def park_ahead(self) -> bool: ...
    def plan(
        self,
        pool: KvPool,
        requests: list[RequestView],
        slot_buffer_capacity: list[int],
        now_ms: int,
    ) -> list[Action]:
        """The actions for this step.

        slot_buffer_capacity: per slot, the park buffer it keeps (a slot past the end keeps
        none). KeyError for a sequence the pool does not have; ValueError for a request id or
        slot given twice.
        """

    def choose_victims(
        self,
        pool: KvPool,
        requests: list[RequestView],
        slot_buffer_capacity: list[int],
        shortfall_cells: int,
    ) -> list[Action]:
        """Victims for a step that failed to allocate shortfall_cells cells.

        "release_buffer" and "park" actions, by the same rules as plan(). Errors as plan().
        """

def round_up_buffer(need: int, cap: int, held: int, budget: int) -> int:
    """The capacity a slot's park buffer takes for a need-byte state.

    Kept if cap holds it, else grown by half again rounded up to 64 KiB if
    held - cap + 2 * grown <= budget, else need rounded up to 64 KiB. held counts every slot's
    buffer, this one's included; budget -1: no limit. ValueError on a bad budget.
    """

def _blockmm_q4(
    x: int, rows: int, k: int, qs: int, scale: int, offset: int, n: int, y: int
) -> None:
    """y[rows, n] = x[rows, k] @ W.T for 4-bit block weights (qs [n, k/2] u8, scale and offset
    [n, k/32] f32), all C-contiguous CPU memory at the given addresses. Private: see
    kvpark.model.ops.block_weights, which checks the tensors behind the addresses.
    """

def _blockmm_q8(
    x: int, rows: int, k: int, qs: int, scale: int, offset: int, n: int, y: int
) -> None:
    """y[rows, n] = x[rows, k] @ W.T for 8-bit block weights (qs [n, k] i8, scale [n, k/32] f32,
    offset [n, k/32] f32 or 0 for none: weight = scale * q + offset). Private: see
    kvpark.model.ops.block_weights.
    """

def _blockmm_q4_i8(
    x: int, rows: int, k: int, qs: int, scale: int, offset: int, n: int, y: int
) -> None:
    """_blockmm_q4 through int8 activations (kvpark_cpu_ops::int8: x rounded to int8 per block of
    32, integer dot products, the same bits on every CPU path). Private, like _blockmm_q4.
    """

def _blockmm_q8_i8(
    x: int, rows: int, k: int, qs: int, scale: int, offset: int, n: int, y: int
) -> None:
    """_blockmm_q8 through int8 activations (see _blockmm_q4_i8); offset 0 for none."""

def _blockmm_q6(x: int, rows: int, k: int, qs: int, scale: int, n: int, y: int) -> None:
    """y[rows, n] = x[rows, k] @ W.T for Q6_K weights unpacked (qs [n, k] i8, scale [n, k/16] f32:
    weight = scale * q, a scale per 16 weights). Private: see kvpark.model.ops.block_weights.
    """

def _blockmm_q6_i8(x: int, rows: int, k: int, qs: int, scale: int, n: int, y: int) -> None:
    """_blockmm_q6 through int8 activations (see _blockmm_q4_i8)."""

def _decode_attention(
    q: int,
    n_q_values: int,
    k: int,
    v: int,
    n_kv_values: int,
    kv_dtype: int,
    cells: int,
    seqs: int,
    stride: int,
    context: int,
    rows: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    out: int,
) -> None:
    """Decode attention read in place from the paged pool: q [rows, heads, head_dim] f32, k and v
    [cells, kv_heads, head_dim] of kv_dtype (0 f32, 1 bf16, 2 f16; n_kv_values each), cells
    [seqs, stride] i64, context and rows [seqs] i64, out like q (only the sequences' rows
    written). See kvpark.model.ops.cpu_attention (private), which checks the tensors behind the
    addresses.
    """

def _rms_norm(x: int, n_values: int, weight: int, d: int, eps: float, out: int) -> None:
    """RMSNorm of rows = n_values / d: x [rows, d] f32, weight [d] f32, out like x. Private: see
    kvpark.model.ops.norm, which checks the tensors behind the addresses.
    """

def _cpu_pack_q4(
    qs: int,
    scale: int,
    offset: int,
    n: int,
    k: int,
    out_qs: int,
    out_scale: int,
    out_offset: int,
) -> None:
    """Packs a 4-bit matrix (qs [n, k/2] u8, scale and offset [n, k/32] f32, row layout) into the
    arrays at `out_*` (the same sizes) in the layout of kvpark_cpu_ops::packed, which the
    decoder's side-by-side kernels read without transposing. `n` a multiple of 16. Private: see
    kvpark.model.gguf_blocks.
    """

def _cpu_pack_q5(
    qs: int,
    scale: int,
    offset: int,
    n: int,
    k: int,
    out_qs: int,
    out_scale: int,
    out_offset: int,
) -> None:
    """Packs a Q5_K matrix as the loader holds it (q8 blocks: qs [n, k] i8 in 0..32, scale and
    offset [n, k/32] f32, row layout) compact into the arrays at `out_*`
    (`kvpark_cpu_ops::q5_packed_lengths`: the quants and int8 values, the `d` and the `dmin`);
    a ValueError where it is not a Q5_K's. Private: see kvpark.model.gguf_blocks.
    """

def _cpu_pack_q5_blocks(
    qs: int,
    scale: int,
    offset: int,
    n: int,
    k: int,
    low: int,
    out_qs: int,
    out_scale: int,
    out_offset: int,
) -> None:
    """Packs a Q5_0 or Q5_1 matrix (q8 blocks, quants in ``low..low + 32``) compact; private:
    see kvpark.model.block_packing."""

def _cpu_pack_q6(qs: int, scale: int, n: int, k: int, out_qs: int, out_scale: int) -> None:
    """Packs a q6 matrix (qs [n, k] i8, scale [n, k/16] f32, row layout) into the arrays at
    `out_*` (compact: `kvpark_cpu_ops::q6_packed_lengths`), as [`_cpu_pack_q4`] does; a
    ValueError where its quants or scales are not a K-quant's. Private: see
    kvpark.model.gguf_blocks.
    """

def _cpu_set_threads(n: int) -> None:
    """How many threads the CPU kernels (block matmuls, decode attention) use (1: the calling
    thread only).
    """

def _cpu_features() -> tuple[dict[str, bool | str], dict[str, bool | str]]:
    """The CPU features the kernels see, `(cpu, effective)`: each a dict of flag -> bool plus
    `"isa"` (plain, avx2 or avx512); `effective` is `cpu` under the cap in `KVPARK_CPU_ISA`.
    Raises ValueError for a value that variable cannot hold.
    """

class _Matrix(TypedDict):
    # blocks: "4" (q4), "8" (q8), "6" (q6); dense: "f" (f32), "h" (f16), "b" (bf16), qs its values
    kind: str
    qs: int
    scale: int
    offset: int
    n: int
    k: int

class _ExpertSpec(TypedDict):
    gate_up: list[_Matrix]
    down: _Matrix

class _LayerSpec(TypedDict):
    attn_norm: int
    qkv: list[_Matrix]  # a fused matrix's parts, rows in order
    qkv_bias: int
    q_norm: int
    k_norm: int
    o: _Matrix
    o_bias: int
    mlp_norm: int
    gate_up: list[_Matrix]  # a dense MLP's ([] in a mixture's layer)
    down: _Matrix | None
    router: _Matrix | None  # a mixture of experts' ([experts, hidden]), None for a dense MLP
    experts: list[_ExpertSpec]
    top_k: int
    norm_topk: bool
    k_cells: int
    v_cells: int
    post_attn_norm: int
    post_mlp_norm: int
    sliding: bool
    rope: int

class _DecoderFeatures(TypedDict):
    act: str  # "s" (silu) or "g" (gelu_tanh)
    embed_scale: float
    attn_scale: float
    attn_softcap: float  # 0: none
    final_softcap: float  # 0: none
    window: int  # 0: no layer slides

@final
class _CpuDecoder:
    """A whole CPU decode step in one call. Private: see kvpark.runner.cpu_decoder, which keeps
    every tensor behind the addresses alive and checks it."""

    def __new__(
        cls,
        shape: tuple[int, int, int, int, int, int],
        eps: float,
        embed: _Matrix,
        norm: int,
        head: _Matrix,
        ropes: list[tuple[int, int]],
        rope_values: int,
        layers: list[_LayerSpec],
        kv_values: int,
        kv_dtype: str,
        dot: str,
        features: _DecoderFeatures,
        window_kv_values: int = 0,
    ) -> _CpuDecoder: ...
    def step(
        self,
        tokens: list[int],
        positions: list[int],
        slots: list[int],
        item_rows: list[int],
        page_tables: list[list[int]],
        page_size: int,
        logit_rows: list[int],
        logits: int,
        window_slots: list[int] = ...,
        window_tables: list[list[int]] = ...,
    ) -> None:
        """Runs one step and writes the logits of ``logit_rows`` into the f32 buffer at
        ``logits`` ([len(logit_rows), vocab]); ``window_slots`` and ``window_tables``: the
        sliding layers' cells in a window space of their own (empty: they share the cells)."""
    def hidden(
        self,
        tokens: list[int],
        positions: list[int],
        slots: list[int],
        item_rows: list[int],
        page_tables: list[list[int]],
        page_size: int,
        rows: list[int],
        out: int,
        window_slots: list[int] = ...,
        window_tables: list[list[int]] = ...,
    ) -> None:
        """As ``step`` (the same K/V writes), but writes the hidden states of ``rows`` after
        the model's final norm, the head's input, into the f32 buffer at ``out``
        ([len(rows), hidden])."""

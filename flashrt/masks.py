"""Mask and batching arguments of flashrt.forward / backward: checks and kernel fields.

kernels_cu/attention/mask.cuh applies them; flashrt/reference.py: visible() is their
specification. `Masking.parse` checks every argument it can without reading device
data (a clear error naming it), and `Masking` carries what the launcher needs: the
compile-time feature bits (params.MASK_BITS), the kernels' run-time fields, and the
problem's geometry (for packed varlen: number of sequences, longest lengths, total rows).
The arrays' data (ids, lengths, offsets) are checked on the device, after the call's
kernels (kernels_cu/helpers/mask_check.cu: no host copy, no synchronisation); a failure is
reported by `raise_reported` at the next call (or flashrt.synchronize()), in the words below.
"""
from __future__ import annotations

import dataclasses
import re

import numpy as np

from . import interop, launch
from .interop import Array
from .params import CHECK_FAILURES, REPORT_WORDS
from .spec import MASK_BITS, MAX_MOD_TENSORS, MOD_VARIABLES, SCORE_VARIABLES

CAUSAL_MODES = (False, True, "bottom_right", "top_left")
# Keyword arguments of forward / backward that are device arrays, and all mask keywords.
ARRAY_ARGS = ("seqlens_q", "seqlens_k", "cu_seqlens_q", "cu_seqlens_k", "block_ids_q", "block_ids_k",
              "segment_ids_q", "segment_ids_k")
# The params field (params.py) that carries each array's pointer.
ARRAY_FIELDS = dict(zip(ARRAY_ARGS, ("seqlens_q", "seqlens_k", "cu_q", "cu_k", "block_q", "block_k", "seg_q", "seg_k")))
_ARRAY_FIELD_SET = frozenset(ARRAY_FIELDS.values())
ARGS = ARRAY_ARGS + ("window", "max_seqlen_q", "max_seqlen_k", "mask_mod", "mask_tensors", "score_mod",
                     "score_mod_grad", "score_tensors")
_IDENTIFIER = re.compile(r"[A-Za-z_]\w*")


# validate= of forward / backward / attention -> its mode: 0 no check, 1 the device check (reported at the
# next call), 2 the device check and a synchronisation, so that the call itself raises.
VALIDATE_MODES = {False: 0, True: 1, "sync": 2}


def validate_mode(validate) -> int:
    try:
        return VALIDATE_MODES[validate]
    except (KeyError, TypeError):
        raise ValueError(f"validate must be True, False or 'sync', got {validate!r}") from None


def check_names(mask_args: dict, fn: str) -> None:
    for name in mask_args:
        if name not in ARGS:
            raise TypeError(f"{fn}() got an unexpected keyword argument {name!r} (mask arguments: {', '.join(ARGS)})")


@dataclasses.dataclass(frozen=True)
class Masking:
    causal: bool
    bits: int               # spec.MASK_BITS compiled into the kernels
    fields: dict            # params fields: id / length pointers, window, alignment
    varlen: bool
    B: int                  # sequences (varlen: len(cu_seqlens) - 1)
    Sq: int                 # longest query / key sequence (the grid's extent)
    Sk: int
    total_q: int            # rows of q / k (varlen), else B * Sq / B * Sk
    total_k: int
    arrays: tuple = ()      # the id / length arrays, kept alive for the launch
    mask_mod: str = ""      # the user's expression, and the names of its tensors
    mod_tensors: tuple = ()
    mod_per_head: bool = False   # the expression names h: tile lists per query head
    mod_per_batch: bool = False  # it names b or a tensor, or a built-in mask varies by batch entry
    score_mod: tuple = ()        # a user's score_mod: spec.KernelSpec.score_mod's (expression, derivative, tensors)

    @property
    def static_lists(self) -> bool:
        """mask_mod's tile lists depend on the call's shapes and options only (no arrays: its tensors are too)."""
        return bool(self.mask_mod) and not self.arrays

    @property
    def ordered_dq_ok(self) -> bool:
        """The fused backward can add dQ in a fixed order (kernels_cu/attention/mask.cuh: first_key_tile_of)."""
        return not self.bits & (MASK_BITS["segments"] | MASK_BITS["mod"])

    def mod_lists(self, H: int) -> tuple[int, int]:
        """(heads, batch entries) with a tile list of their own (kernels_cu/attention/mask.cuh: ModLists)."""
        return (H if self.mod_per_head else 1), (self.B if self.mod_per_batch else 1)

    def stat_strides(self, H: int) -> dict:
        """lse (and delta, dq_accum rows) layout: (B, H, Sq), or (H, total_q) when varlen."""
        return dict(st_sb=0, st_sh=self.total_q) if self.varlen else dict(st_sb=H * self.Sq, st_sh=self.Sq)

    @property
    def checked(self) -> bool:
        """Some id / length / offset array is given: the device check has data to read."""
        return not _ARRAY_FIELD_SET.isdisjoint(self.fields)

    def check_fields(self, backward: bool) -> dict:
        """params.CHECK's fields (kernels_cu/helpers/mask_check.cu) but the outputs and the report."""
        return {**{f: p for f, p in self.fields.items() if f in _ARRAY_FIELD_SET}, "B": self.B, "Sq": self.Sq,
                "Sk": self.Sk, "total_q": self.total_q, "total_k": self.total_k,
                "call": int(backward) | 2 * self.varlen}

    def lse_shape(self, H: int) -> tuple[int, ...]:
        return (H, self.total_q) if self.varlen else (self.B, H, self.Sq)

    def kernel_fields(self, H: int) -> dict:
        """Every params field this masking sets (params.FWD / BWD); the tile lists' pointers aside."""
        heads, batches = self.mod_lists(H)
        return {**self.fields, **self.stat_strides(H), "B": self.B, "Sq": self.Sq, "Sk": self.Sk,
                "total_q": self.total_q, "total_k": self.total_k, "mod_heads": heads, "mod_batches": batches}

    def elementwise_fields(self, H: int) -> dict:
        """Overrides for the row-wise families (bwd_preprocess, bwd_dq_convert): packed rows are one batch."""
        return dict(B=1, Sq=self.total_q, Sk=self.total_k, st_sb=0, st_sh=self.total_q) if self.varlen else {}

    @staticmethod
    def parse(Q: Array, K: Array, *, causal=False, window=None, seqlens_q=None, seqlens_k=None,
              cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, block_ids_q=None,
              block_ids_k=None, segment_ids_q=None, segment_ids_k=None, mask_mod=None,
              mask_tensors=None, score_mod=None, score_mod_grad=None, score_tensors=None) -> "Masking":
        """Q, K: the descriptors of q and k as given ((B, S, H, D), or (total, H, D) when varlen). Reads no
        device data, but cu_seqlens' (a host copy) for a max_seqlen not given."""
        if causal not in CAUSAL_MODES or isinstance(causal, (int, float)) and not isinstance(causal, bool):
            raise ValueError(f"causal must be one of {CAUSAL_MODES}, got {causal!r}")
        fields: dict = {"top_left": int(causal == "top_left")}
        bits, arrays = 0, []
        varlen = cu_seqlens_q is not None or cu_seqlens_k is not None

        def int_array(x, name, shape=None):
            """The pointer of an int32 device array (of `shape`, or any shape when None)."""
            a = interop.describe(x, name)
            shape = a.shape if shape is None else shape
            interop.check_beside(a, Q, name)
            if a.dtype != "int32":
                raise TypeError(f"{name} must be int32, got {a.dtype}: pass {name}.to(torch.int32) / "
                                f"{name}.astype(cupy.int32)")
            if a.shape != shape:
                raise ValueError(f"{name} must have shape {shape}, got {a.shape}")
            interop.check_contiguous(a, name)
            arrays.append(x)
            return a.ptr

        if varlen:
            if cu_seqlens_q is None or cu_seqlens_k is None:
                raise ValueError("packed varlen needs both cu_seqlens_q and cu_seqlens_k")
            if seqlens_q is not None or seqlens_k is not None:
                raise ValueError("pass either cu_seqlens_q/k (packed varlen) or seqlens_q/k (padding), not both")
            if len(Q.shape) != 3 or len(K.shape) != 3:
                raise ValueError(f"with cu_seqlens, q, k and v are packed (total_tokens, heads, head_dim); got q "
                                 f"{Q.shape}, k {K.shape}")
            total_q, total_k = Q.shape[0], K.shape[0]
            cu_len = interop.describe(cu_seqlens_q, "cu_seqlens_q").shape
            if len(cu_len) != 1 or cu_len[0] < 1:
                raise ValueError(f"cu_seqlens_q must have shape (batch + 1,), got {cu_len}")
            B = cu_len[0] - 1
            fields[ARRAY_FIELDS["cu_seqlens_q"]] = int_array(cu_seqlens_q, "cu_seqlens_q", (B + 1,))
            fields[ARRAY_FIELDS["cu_seqlens_k"]] = int_array(cu_seqlens_k, "cu_seqlens_k", (B + 1,))
            Sq = _max_len(max_seqlen_q, "max_seqlen_q", cu_seqlens_q)
            Sk = _max_len(max_seqlen_k, "max_seqlen_k", cu_seqlens_k)
            q_ids_shape, k_ids_shape = (total_q,), (total_k,)
            bits |= MASK_BITS["lengths"]
        else:
            for a, name in ((Q, "q"), (K, "k")):
                if len(a.shape) != 4:
                    raise ValueError(f"{name} must have 4 dimensions (batch, seqlen, heads, head_dim), got shape "
                                     f"{a.shape} (packed (total, heads, head_dim) inputs need cu_seqlens_q / "
                                     f"cu_seqlens_k)")
            B, Sq, Sk = Q.shape[0], Q.shape[1], K.shape[1]
            total_q, total_k = B * Sq, B * Sk
            q_ids_shape, k_ids_shape = (B, Sq), (B, Sk)
            for x, name in ((seqlens_q, "seqlens_q"), (seqlens_k, "seqlens_k")):
                if x is None:
                    continue
                fields[ARRAY_FIELDS[name]] = int_array(x, name, (B,))
                bits |= MASK_BITS["lengths"]

        if window is not None:
            try:
                left, right = (int(w) for w in window)
            except (TypeError, ValueError):
                raise ValueError(f"window must be a pair (left, right) of ints, -1 = unbounded; got {window!r}")
            if left < -1 or right < -1:
                raise ValueError(f"window sizes must be >= 0, or -1 for unbounded; got {window!r}")
            if (left, right) != (-1, -1):
                fields.update(win_left=left, win_right=right)
                bits |= MASK_BITS["window"]

        for kind, (xq, xk), bit in (("block_ids", (block_ids_q, block_ids_k), "block_ids"),
                                    ("segment_ids", (segment_ids_q, segment_ids_k), "segments")):
            if xq is None and xk is None:
                continue
            if xq is None or xk is None:
                raise ValueError(f"{kind}_q and {kind}_k go together; got only {kind}_{'q' if xk is None else 'k'}")
            fields[ARRAY_FIELDS[f"{kind}_q"]] = int_array(xq, f"{kind}_q", q_ids_shape)
            fields[ARRAY_FIELDS[f"{kind}_k"]] = int_array(xk, f"{kind}_k", k_ids_shape)
            bits |= MASK_BITS[bit]

        mod, names, per_head, per_batch = "", (), False, False
        if mask_mod is not None or mask_tensors:
            mod, names = _check_mask_mod(mask_mod, mask_tensors)
            for i, (name, x) in enumerate((mask_tensors or {}).items()):
                fields[f"mod_t{i}"] = int_array(x, f"mask_tensors[{name!r}]")
            used = set(_IDENTIFIER.findall(mod))
            per_head = "h" in used
            per_batch = "b" in used or bool(names) or bool(bits & ~MASK_BITS["window"])
            bits |= MASK_BITS["mod"]
        score = ()
        if score_mod is not None or score_mod_grad is not None or score_tensors:
            expr, grad = _check_score_mod(score_mod, score_mod_grad, score_tensors)
            types = []
            for i, (name, x) in enumerate((score_tensors or {}).items()):
                fields[f"score_t{i}"], ctype = _score_array(x, f"score_tensors[{name!r}]", Q)
                types.append((name, ctype))
            score = (expr, grad, tuple(types))
        return Masking(bool(causal), bits, fields, varlen, B, Sq, Sk, total_q, total_k, tuple(arrays), mod, names,
                       per_head, per_batch, score)


def _max_len(given, name: str, cu) -> int:
    """max_seqlen_q / _k: as given (the device check reports a sequence longer than it), else the longest
    sequence of cu_seqlens, from a host copy (which synchronises)."""
    if given is not None:
        if int(given) < 0:
            raise ValueError(f"{name} must be >= 0, got {given}")
        return int(given)
    cu_host = interop.to_numpy(interop.describe(cu, name.replace("max_seqlen", "cu_seqlens")))
    return int(np.diff(cu_host).max(initial=0))


def _check_mask_mod(expr, tensors) -> tuple[str, tuple]:
    """The expression and its tensors' names, checked for what can be checked before NVRTC sees them."""
    if not isinstance(expr, str) or not expr.strip():
        raise ValueError(f"mask_mod must be a CUDA boolean expression over {', '.join(MOD_VARIABLES)} (and the "
                         f"names of mask_tensors), such as \"k <= q || k < 256\"; got {expr!r}")
    tensors = tensors or {}
    _check_names(tensors, "mask_tensors", MOD_VARIABLES)
    if expr.rstrip().endswith("\\"):
        raise ValueError(f"mask_mod must not end in a backslash (it would continue onto flashrt's next line): {expr!r}")
    return expr.strip(), tuple(tensors)


def _check_names(tensors, what: str, reserved: tuple) -> None:
    """The keys of mask_tensors / score_tensors: C identifiers the expression can name its tensors by."""
    if not isinstance(tensors, dict):
        raise TypeError(f"{what} must be a dict of name -> device array, got {type(tensors).__name__}")
    if len(tensors) > MAX_MOD_TENSORS:
        raise ValueError(f"{what} holds at most {MAX_MOD_TENSORS} arrays, got {len(tensors)}")
    for name in tensors:
        if not isinstance(name, str) or not _IDENTIFIER.fullmatch(name) or name in _CPP_KEYWORDS \
                or name in reserved or re.fullmatch(r"t\d|(?i:frt)\w*|flashrt\w*|__\w*", name):
            raise ValueError(f"{what} key {name!r} must be a C identifier other than a C++ keyword, "
                             f"{', '.join(reserved)}, t0-t3, frt*/FRT* and flashrt*: it names the tensor in "
                             f"the expression")


def _check_score_mod(expr, grad, tensors) -> tuple[str, str]:
    """score_mod's expression and derivative ("" for the automatic one), checked for what can be checked before
    NVRTC sees them; then its tensors' names."""
    for value, name in ((expr, "score_mod"), (grad, "score_mod_grad")):
        if value is None and name == "score_mod_grad":
            continue
        if not isinstance(value, str) or not value.strip():
            what = ("a CUDA float expression, the new scaled score" if name == "score_mod" else
                    "a CUDA float expression, the derivative of score_mod in s (or None: derived automatically)")
            raise ValueError(f"{name} must be {what}, over float s (softmax_scale * q.k), int "
                             f"{', '.join(MOD_VARIABLES)}, float qf, kf (q and k as floats) and the names of "
                             f"score_tensors, such as "
                             f"\"30.f * tanhf(s * (1.f / 30.f))\"; got {value!r}")
        if value.rstrip().endswith("\\"):
            raise ValueError(f"{name} must not end in a backslash (it would continue onto flashrt's next line): "
                             f"{value!r}")
    _check_names(tensors or {}, "score_tensors", SCORE_VARIABLES)
    return expr.strip(), (grad or "").strip()


def _score_array(x, name: str, Q: Array) -> tuple[int, str]:
    """A score_mod tensor's pointer and element type (spec.SCORE_TENSOR_TYPES): float32 or int32, any shape,
    contiguous, beside q."""
    a = interop.describe(x, name)
    interop.check_beside(a, Q, name)
    types = {"float32": "float", "int32": "int"}
    if a.dtype not in types:
        raise TypeError(f"{name} must be float32 (read as const float*) or int32 (const int*), got {a.dtype}")
    interop.check_contiguous(a, name)
    return a.ptr, types[a.dtype]


def score_mod_error(score: tuple, log: str) -> ValueError:
    """A score_mod (spec.KernelSpec.score_mod) that NVRTC rejected: the messages about the user's expressions, with
    NVRTC's caret under the fault; where only the automatic derivative failed, how to give one."""
    from .spec import SCORE_DUAL_FILE, SCORE_END_FILE, SCORE_FILE, SCORE_GRAD_FILE, SCORE_TGRAD_FILE, read_types
    expr, grad, tensors = score
    tensors = read_types(tensors)
    lines = [re.sub(re.escape(SCORE_END_FILE) + r"\(\d+\)", "the expression's end", ln)
             for ln in log.rstrip().splitlines()
             if not ln.rstrip().endswith('.cu".') and "error detected" not in ln and "errors detected" not in ln]
    text = "\n  ".join(ln for ln in lines if ln.strip())
    names = ", ".join(("float s",) + MOD_VARIABLES + ("float qf", "float kf")
                      + tuple(f"const {t}* {n}" for n, t in tensors))
    mine = (SCORE_FILE + "(", SCORE_GRAD_FILE + "(")
    if SCORE_DUAL_FILE in log and not any(ln.startswith(mine) for ln in lines):
        return ValueError(f"score_mod's automatic derivative does not compile: the expression is differentiated by "
                          f"evaluating it over dual numbers, which support + - * /, comparisons and the common math "
                          f"functions (tanhf, expf, logf, sqrtf, fabsf, fminf, fmaxf, powf, ...), but not casts of s "
                          f"or other functions. Pass score_mod_grad=\"...\", the derivative in s as a CUDA expression "
                          f"over the same names.\n  {text}\n(the expression: {expr!r})")
    if SCORE_TGRAD_FILE in log and not any(ln.startswith(mine) for ln in lines):
        return ValueError(f"the gradient of score_mod's tensors does not compile: it evaluates the expression with "
                          f"each read of a tensor that takes a gradient (name[index]) as a dual number, which supports "
                          f"+ - * /, comparisons and the common math functions, but not casts of the value read or "
                          f"other functions; detach the tensor (no gradient), or write the read in float arithmetic."
                          f"\n  {text}\n(the expression: {expr!r})")
    shown = f"(the expression: {expr!r}" + (f", its derivative: {grad!r})" if grad else ")")
    return ValueError(f"score_mod does not compile as a CUDA float expression over {names}:\n  {text}\n{shown}")


_CPP_KEYWORDS = frozenset("""alignas alignof and and_eq asm auto bitand bitor bool break case catch char char16_t
    char32_t class compl const constexpr const_cast continue decltype default delete do double dynamic_cast else
    enum explicit export extern false float for friend goto if inline int long mutable namespace new noexcept not
    not_eq nullptr operator or or_eq private protected public register reinterpret_cast return short signed sizeof
    static static_assert static_cast struct switch template this thread_local throw true try typedef typeid
    typename union unsigned using virtual void volatile wchar_t while xor xor_eq""".split())


def mask_mod_error(expr: str, tensors: tuple, log: str) -> ValueError:
    """A mask_mod that NVRTC rejected: its messages about the expression, with NVRTC's caret under the fault."""
    from .spec import MOD_END_FILE, MOD_FILE
    lines = [re.sub(MOD_END_FILE + r"\(\d+\)", f"{MOD_FILE} (at its end)", ln) for ln in log.rstrip().splitlines()
             if not ln.rstrip().endswith('.cu".') and "error detected" not in ln and "errors detected" not in ln]
    names = ", ".join(MOD_VARIABLES + tuple(f"const int* {n}" for n in tensors))
    return ValueError(f"mask_mod does not compile as a CUDA boolean expression over {names}:\n  " +
                      "\n  ".join(ln for ln in lines if ln.strip()) + f"\n(the expression: {expr!r})")




def raise_reported() -> None:
    """Raise the failure a device check reported (launch.report_words), if one did since the last was raised."""
    words = launch.REPORT
    if words is None or words[0] <= 0:  # (-1: a kernel is writing a report)
        return
    report = dict(zip(REPORT_WORDS, words))
    words[0] = 0
    raise ValueError(report_message(report))


def report_message(r: dict) -> str:
    """The error for a device check's report: the rule, where the data break it, and when it was found."""
    failure = CHECK_FAILURES[r["code"] - 1]
    if r["call"] == 4:  # kernels_cu/sm80/decode.cu
        if failure == "cache_seqlens":
            text = (f"cache_seqlens[{r['seq']}] = {r['value']} is outside [0, {r['limit']}] (the cache's capacity "
                    f"less the new tokens appended)")
        else:
            text = f"page_table of sequence {r['seq']} holds page id {r['value']}, outside [0, {r['limit']})"
        return (f"{text}. (Found on the GPU by an earlier flashrt.decode call, which read nothing there and set the "
                f"rows concerned to NaN; such errors are raised at the next flashrt call or at flashrt.synchronize().)")
    name = ARRAY_ARGS[r["arg"]]
    side = name[-1]
    cu_rule = f"{name} must start at 0, be non-decreasing and end at most at the packed length"
    if failure == "length":
        text = (f"{name} must lie in [0, {r['limit']}] (the tensor's seqlen axis), got {r['value']} for batch "
                f"entry {r['seq']}")
    elif failure == "cu_start":
        text = f"{cu_rule}; it starts at {r['value']}"
    elif failure == "cu_order":
        text = f"{cu_rule}; entry {r['seq']} ({r['value']}) is below entry {r['seq'] - 1} ({r['limit']})"
    elif failure == "cu_end":
        text = f"{cu_rule} ({r['limit']}); it ends at {r['value']}"
    elif failure == "cu_longest":
        text = (f"max_seqlen_{side}={r['limit']} is below the length of sequence {r['seq']} in {name} ({r['value']}); "
                f"pass the longest length, or leave max_seqlen_{side} out")
    else:
        rule = "block_ids_k[j] <= block_ids_q[i]" if "block" in name else "the ids are equal"
        where = "sequence" if r["call"] & 2 else "batch"
        text = (f"{name} must be non-decreasing along each sequence (key j is visible to query i iff {rule}; flashrt "
                f"skips tiles by that order); {name} decreases in {where} {r['seq']} at position {r['pos']} "
                f"({r['value']} after {r['limit']})")
    call = "backward" if r["call"] & 1 else "forward"
    return (f"{text}. (Found on the GPU by the validate=True check of an earlier flashrt {call} call, whose outputs "
            f"were set to NaN; such checks report at the next flashrt call or at flashrt.synchronize(), and "
            f"validate='sync' makes the call itself raise.)")

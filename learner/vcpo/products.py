"""The per-sample gradient algebra behind VCPO's norms (`learner/vcpo/ghost_norms.py` collects the pieces): a
parameter's per-sample gradient as factors sum_t a_t (x) b_t or dense, its squared norm through Gram matrices
or the dense form, whichever costs fewer FLOPs, cross terms of tied weights, and weighted sums over samples.
Every product is a GEMM in the model's dtype (tensor cores on a GPU); only reductions run in fp32."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor

# Samples per Gram-matrix chunk: bounds the [chunk, T, T] and [chunk, out, in] temporaries.
CHUNK_ELEMENTS = 1 << 25


@dataclass
class Factors:
    """A per-sample gradient sum_t left_t (x) right_t; `left` is dense [B,T,m] or token ids [B,T]
    (one-hot rows of a table with `rows` rows)."""

    left: Tensor
    right: Tensor
    rows: int = 0

    @property
    def dense_is_smaller(self) -> bool:
        """Whether the dense per-sample gradient [B, m, n] holds fewer numbers than its factors: what
        book-keeping keeps of it."""
        steps, cols = self.right.shape[1], self.right.shape[-1]
        if self.indexed:
            return self.rows * cols <= steps * steps
        rows = self.left.shape[-1]
        return rows * cols <= steps * (rows + cols)

    @property
    def dense_is_cheaper(self) -> bool:
        """Whether the squared norm costs fewer FLOPs through the dense per-sample gradient (form it, then
        its squared sum) than through the two Gram matrices (two [T, T] products, then their inner product)."""
        steps, cols = self.right.shape[1], self.right.shape[-1]
        if self.indexed:  # dense: a scatter of the T rows and the squared sum; Gram: a compare and one product
            return steps * cols + 2 * self.rows * cols <= 2 * steps * steps * cols + 3 * steps * steps
        return dense_costs_less(steps, self.left.shape[-1], cols)

    def dense(self) -> Tensor:
        """The per-sample gradient [B, m, n] itself."""
        if not self.indexed:
            return torch.bmm(self.left.transpose(1, 2), self.right)
        cols = self.right.shape[-1]
        index = self.left.unsqueeze(-1).expand(-1, -1, cols)
        return self.right.new_zeros(self.right.shape[0], self.rows, cols).scatter_add_(1, index, self.right)

    @property
    def indexed(self) -> bool:
        return self.left.dim() == 2


def dense_costs_less(steps: int, rows: int, cols: int) -> bool:
    """Whether a squared norm of sum_t a_t (x) b_t over `steps` positions, a_t of `rows` numbers and b_t of
    `cols`, costs fewer FLOPs through the dense [rows, cols] gradient (form it, then its squared sum) than
    through the two [steps, steps] Gram matrices and their inner product."""
    return 2 * steps * rows * cols + 2 * rows * cols <= 2 * steps * steps * (rows + cols) + 2 * steps * steps


def _left_gram(p: Factors, q: Factors) -> Tensor:
    """[B, T_p, T_q] inner products of the left factors (one-hot rows become gathers)."""
    if p.indexed and q.indexed:
        return (p.left[:, :, None] == q.left[:, None, :]).to(p.right.dtype)
    if p.indexed:
        return _left_gram(q, p).transpose(1, 2)
    if q.indexed:  # dense a_t . onehot(id_s) = a_t[id_s]
        index = q.left[:, None, :].expand(-1, p.left.shape[1], -1)
        return torch.gather(p.left, 2, index)
    return torch.bmm(p.left, q.left.transpose(1, 2))


def factor_inner(p: Factors, q: Factors) -> Tensor:
    """Per-sample <G_p, G_q>, [B] fp32, in chunks of samples; materialises G when that costs fewer FLOPs."""
    batch, steps = p.right.shape[:2]
    if p is q and p.dense_is_cheaper:
        per_sample = (p.rows if p.indexed else p.left.shape[-1]) * p.right.shape[-1]
        return joined([self_dot(sliced(p, i, n).dense()) for i, n in sample_chunks(batch, per_sample)])
    per_sample = steps * q.right.shape[1]
    return joined([_gram_inner(sliced(p, i, n), sliced(q, i, n)) for i, n in sample_chunks(batch, per_sample)])


def _gram_inner(p: Factors, q: Factors) -> Tensor:
    """Per-sample sum_{t,s} <p.left_t, q.left_s> <p.right_t, q.right_s>: the two Gram matrices' inner product."""
    return (_left_gram(p, q) * torch.bmm(p.right, q.right.transpose(1, 2))).sum((1, 2), dtype=torch.float32)


class InputGramSum:
    """Squared norms of the weight gradients of calls that share one input X (q, k and v; gate and up), per
    sample: sum_j ||G_j^T X||^2 = <X X^T, sum_j G_j G_j^T>. The output gradients' Grams are summed as they come
    (one accumulating product each) and the input's Gram is formed once for them all: one product and one
    reduction for the group instead of one each per call. Calls whose own route is dense, or whose [B, T, T]
    Grams are too large to hold (`alive`), are not taken (`add` says so) and go through `squared_norm`."""

    def __init__(self, alive: int = 1) -> None:
        """`alive`: how many sums are held at once (one per row bucket). Together they stay within half a Gram
        chunk, so that with the input's Gram and their product formed at the end the norms pass stays within
        the Gram chunks the memory model counts (`learner.memory_budget.LIVE_CHUNKS`)."""
        self.max_elements = CHUNK_ELEMENTS // (2 * alive)
        # the shared input X and the sum of the output gradients' Grams, from the first call taken on
        self.taken: tuple[Tensor, Tensor] | None = None

    def add(self, part: Contribution) -> bool:
        """Take a call's factors (its left factor the output gradient, its right the shared input)."""
        if isinstance(part, Tensor) or part.indexed or part.dense_is_cheaper:
            return False
        batch, steps = part.left.shape[:2]
        if batch * steps * steps > self.max_elements:
            return False
        left_t = part.left.transpose(1, 2)
        if self.taken is None:
            self.taken = part.right, torch.bmm(part.left, left_t)
        else:
            self.taken[1].baddbmm_(part.left, left_t)
        return True

    def squared_norms(self) -> Tensor | None:
        """[B] fp32, the sum over the calls taken; None when none was."""
        if self.taken is None:
            return None
        right, left_gram = self.taken
        right_gram = torch.bmm(right, right.transpose(1, 2))
        return (left_gram * right_gram).sum((1, 2), dtype=torch.float32)


def sliced(p: Factors, start: int, count: int) -> Factors:
    """Samples start .. start + count of p (p itself when that is all of them: no view to make)."""
    if start == 0 and count == p.right.shape[0]:
        return p
    return Factors(p.left[start : start + count], p.right[start : start + count], p.rows)


def joined(chunks: list[Tensor]) -> Tensor:
    """The chunks' per-sample values end to end (one chunk as it is: no copy kernel)."""
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks)


def self_dot(dense: Tensor) -> Tensor:
    """Per-sample squared norm of [B, ...], [B] fp32: a reduction that accumulates in fp32, without an
    fp32 copy (a batched [1, n] x [n, 1] product would run as matrix-vector kernels)."""
    return torch.linalg.vector_norm(dense.flatten(1), dim=1, dtype=torch.float32).square()


def sample_chunks(batch: int, elements_per_sample: int) -> Iterator[tuple[int, int]]:
    """(start, count) of runs of samples whose temporaries of `elements_per_sample` each hold at most
    CHUNK_ELEMENTS numbers together."""
    size = max(1, CHUNK_ELEMENTS // max(1, elements_per_sample))
    for start in range(0, batch, size):
        yield start, min(size, batch - start)


Contribution = Factors | Tensor
"""A per-sample gradient of one parameter in one call: factors, or dense [B, *parameter shape]."""


def _dense_inner(dense: Tensor, other: Contribution) -> Tensor:
    """Per-sample <G, H>, [B] fp32, for a dense G [B, ...] against a dense or factored H."""
    if other is dense:
        return self_dot(dense)
    if isinstance(other, Tensor):
        return (dense * other).flatten(1).sum(1, dtype=torch.float32)
    if other.indexed:  # G [B, V, d] against sum_t onehot(id_t) (x) right_t: rows of G at the ids
        rows = torch.gather(dense, 1, other.left.unsqueeze(-1).expand(-1, -1, dense.shape[-1]))
        return (rows * other.right).sum((1, 2), dtype=torch.float32)
    return (torch.bmm(other.left, dense) * other.right).sum((1, 2), dtype=torch.float32)  # sum_t a_t^T G b_t


def _pair_inner(p: Contribution, q: Contribution) -> Tensor:
    if isinstance(p, Tensor):
        return _dense_inner(p, q)
    if isinstance(q, Tensor):
        return _dense_inner(q, p)
    return factor_inner(p, q)


def squared_norm(parts: list[Contribution]) -> Tensor:
    """||sum of parts||^2 per sample: each part's own norm plus twice every cross term (tied weights)."""
    # the sums are of non-empty lists (of dense parts where there is one, of the parts a parameter has): tensors
    dense = [part for part in parts if isinstance(part, Tensor)]
    parts = ([_added(dense)] if dense else []) + [part for part in parts if not isinstance(part, Tensor)]
    terms = [_pair_inner(p, p) for p in parts]
    terms += [2 * _pair_inner(p, q) for j, p in enumerate(parts) for q in parts[j + 1 :]]
    return _added(terms)


def _added(terms: list[Tensor]) -> Tensor:
    """The sum of a non-empty list, with no kernel for a single term (Python's sum adds it to 0 first)."""
    total = terms[0]
    for term in terms[1:]:
        total = total + term
    return total


def weighted_sum(part: Contribution, coefficients: Tensor, shape: torch.Size, total: Tensor | None = None) -> Tensor:
    """sum_i c_i G_i for one part, the coefficients [B] in the part's dtype: the parameter gradient of
    sum_i c_i log pi(tau_i), one weight-gradient GEMM for factors. Added in place into `total` when given
    (another part's or bucket's sum, formed here: the addition rides in the same kernel)."""
    if isinstance(part, Tensor):
        term = torch.tensordot(coefficients, part, dims=1)
        return term if total is None else total.add_(term)
    scaled = part.right * coefficients.view(-1, 1, 1)
    if part.indexed:  # embedding rows: scatter each token's scaled output gradient into its row
        into = scaled.new_zeros(shape) if total is None else total
        return into.index_add_(0, part.left.reshape(-1), scaled.flatten(0, 1))
    left, right = part.left.flatten(0, 1).T, scaled.flatten(0, 1)
    return left @ right if total is None else total.addmm_(left, right)


def compact(part: Contribution) -> Contribution:
    """Factors as the dense per-sample gradient when that holds fewer numbers."""
    if isinstance(part, Tensor) or not part.dense_is_smaller:
        return part
    return part.dense()


def folding_costs_less(steps: int, rows: int, cols: int, basis_rows: int) -> bool:
    """Whether a linear weight's per-sample gradients over `steps` positions cost fewer FLOPs formed dense and
    folded at once into `basis_rows` sums (form it 2 T r c, its norm 2 r c, the fold 2 m r c per sample) than
    through the Grams (2 T^2 (r + c) + 2 T^2) and book-keeping's update product afterwards (2 T r c)."""
    return rows * cols * (1 + basis_rows) <= steps * steps * (rows + cols + 1)


class FoldedSums:
    """Book-keeping's per-sample gradients folded into a few sums as they are formed: the official VCPO code's
    two gradient buffers per prompt group. A sample's update coefficient is affine in its group's baseline b_g,
    k_i = u_i - b_g s_i, so the update sum_i k_i G_i is sum_i u_i G_i - sum_g b_g sum_{i in g} s_i G_i. The basis
    holds those rows ([1 + groups, B] fp32: u, then s within each group), each weight's sums are its
    [1 + groups, *shape] fp32 products with the dense G_i, and no G_i is kept once its layer has passed.
    Where a weight's G_i cost fewer FLOPs dense than through the Grams (`folding_costs_less`), the update costs
    no weight-gradient product beyond the plain step's own."""

    def __init__(self, basis: Tensor) -> None:
        self.basis = basis.float()
        self.sums: dict[torch.nn.Parameter, Tensor] = {}
        # each row bucket's columns of the basis in each dtype, formed once for all its layers (the norms pass
        # is bound by the host on a small model: every operator call counts)
        self.bucket_bases: dict[tuple[int, torch.dtype], Tensor] = {}

    def takes(self, part: Contribution, uses: int) -> bool:
        """Whether this call's part of a weight folds: factors of a linear weight used once (a tied weight's cross
        term needs its G_i whole), dense cheaper than the Grams and the update product."""
        if isinstance(part, Tensor) or part.indexed or uses != 1:
            return False
        return folding_costs_less(part.right.shape[1], part.left.shape[-1], part.right.shape[-1], len(self.basis))

    def fold(self, param: torch.nn.Parameter, part: Factors, rows: Tensor | None) -> Tensor:
        """Fold the part's G_i (rows `rows` of the basis; all when None) into the weight's sums, in chunks of
        samples; returns their squared norms [n] fp32."""
        elements = part.left.shape[-1] * part.right.shape[-1]
        basis = self._bucket_basis(rows, part.left.dtype)
        norms = []
        for start, count in sample_chunks(part.right.shape[0], elements):
            dense = sliced(part, start, count).dense()  # [n, out, in] in the model's dtype
            norms.append(self_dot(dense))
            chunk = basis if count == basis.shape[1] else basis[:, start : start + count]
            total = self.sums.get(param)
            if total is None:
                self.sums[param] = torch.mm(chunk, dense.flatten(1)).float().view(len(basis), *param.shape)
            elif dense.dtype == torch.float32:  # the product added in the same kernel
                total.view(len(basis), -1).addmm_(chunk, dense.flatten(1))
            else:
                total.view(len(basis), -1).add_(torch.mm(chunk, dense.flatten(1)))
        return joined(norms)

    def _bucket_basis(self, rows: Tensor | None, dtype: torch.dtype) -> Tensor:
        key = (id(rows), dtype)
        if key not in self.bucket_bases:
            basis = self.basis if rows is None else self.basis[:, rows]
            self.bucket_bases[key] = basis.to(dtype)
        return self.bucket_bases[key]

    def add_into(self, grads: dict[torch.nn.Parameter, Tensor], weights: Tensor | int, fp32: bool = False) -> None:
        """Each folded weight's sum_j weights_j sums_j ([1 + groups] fp32: 1, then -b_g), or with an int its one
        sum of that row, into `grads`, in the parameter's dtype (or fp32)."""
        weights = weights if isinstance(weights, int) else weights.float()
        for param, sums in self.sums.items():
            folded = sums[weights] if isinstance(weights, int) else torch.tensordot(weights, sums, dims=1)
            kept = grads.get(param)  # the same weight's part in row buckets too short to fold
            total = folded if kept is None else kept.float().add_(folded)
            grads[param] = total if fp32 else total.to(param.dtype)


@contextmanager
def tensor_core_products(device: torch.device) -> Iterator[None]:
    """fp32 products as TF32 on CUDA while the norms are formed (bf16 products are tensor-core ones already)."""
    if device.type != "cuda":
        yield
        return
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before

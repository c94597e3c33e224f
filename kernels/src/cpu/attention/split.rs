//! Split-K decode ("flash-decoding"): a long decode context becomes several
//! work items over consecutive ranges of its keys, each leaving its
//! unnormalised output, max and sum; the parts are then merged as the
//! online softmax would have merged them. A batch-1 step of few kv heads
//! so keeps every thread busy, and no item holds a whole long context.

use super::{Elem, Item, PagedAttention};

/// Keys of a decode item at most once its context is split (block-aligned:
/// a multiple of the block size at or above it); contexts up to twice this
/// stay whole.
pub(super) const SPLIT_KEYS: usize = 512;

impl PagedAttention<'_> {
    /// Calls `push` with each key range of a decode at `pos` when its
    /// visible context is long enough to split (ranges block-aligned, in
    /// order); false, pushing nothing, when it stays whole.
    pub(super) fn split_decode(&self, pos: usize, push: &mut dyn FnMut((usize, usize))) -> bool {
        let chunk = SPLIT_KEYS.next_multiple_of(self.dims.block_size.max(1));
        let (first_key, end) = (self.window_start(pos), pos + 1);
        if end - first_key <= 2 * chunk {
            return false;
        }
        let mut k = first_key;
        while k < end {
            let next = ((k / chunk + 1) * chunk).min(end);
            push((k, next));
            k = next;
        }
        true
    }

    /// Each split decode context's partial results merged as the online
    /// softmax would have (every part rescaled to the largest max), then
    /// normalised (sinks included) into its row of `out`.
    /// `slot`: the elements of an item's partial result.
    pub(super) fn merge_split<T: Elem>(
        &self,
        items: &[Item],
        partials: &[f32],
        (group, slot): (usize, usize),
        out: &mut [T],
    ) {
        let hd = self.dims.head_dim;
        let mut i = 0;
        while i < items.len() {
            let first = items[i];
            if !first.is_split() {
                i += 1;
                continue;
            }
            let end = i + items[i..].iter().take_while(|it| (it.seq, it.kv_head) == (first.seq, first.kv_head)).count();
            let heads = first.heads(group);
            let part = |p: usize| &partials[p * slot..][..slot];
            let mut acc = vec![0f32; heads * hd];
            let (mut max, mut sum) = (vec![f32::NEG_INFINITY; heads], vec![0f32; heads]);
            for r in 0..heads {
                max[r] = (i..end).map(|p| part(p)[heads * hd + r]).fold(f32::NEG_INFINITY, f32::max);
                for p in i..end {
                    let (m, s) = (part(p)[heads * hd + r], part(p)[heads * hd + heads + r]);
                    if s == 0.0 {
                        continue;
                    }
                    let w = (m - max[r]).exp();
                    sum[r] += s * w;
                    for (a, &x) in acc[r * hd..][..hd].iter_mut().zip(&part(p)[r * hd..][..hd]) {
                        *a += x * w;
                    }
                }
            }
            self.normalize(first, heads, &mut acc, &max, &sum);
            for j in 0..heads {
                let at = (first.row0 * self.dims.num_heads + first.kv_head * group + j) * hd;
                for (o, &x) in out[at..at + hd].iter_mut().zip(&acc[j * hd..][..hd]) {
                    *o = T::from_f32(x);
                }
            }
            i = end;
        }
    }
}

//! Token ids and cell contents, for the prefix cache: a model-free "greedy model" whose next
//! token is a function of everything before it, and a shadow of what every cell holds.
//!
//! A cell's *content* is a hash of every token up to its position, which is what K and V
//! depend on. Shared prefix `P` is a stream continued greedily from a seed, so a request whose
//! prompt is the first `L` tokens of `P` generates (its first sequence) exactly `P`'s next
//! tokens: a later request with a longer prefix of `P` hits the pages the first one decoded,
//! as a chat's next turn does.

use kvpark_core::{KvPool, PageId};

use super::Seq;
use crate::SimRequest;

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The content of a position holding `token` after content `before` (never 0: unwritten).
pub(super) fn content(before: u64, token: u32) -> u64 {
    mix(before ^ u64::from(token)) | 1
}

/// The token a sequence picks after content `before`; `branch` 0 is the greedy pick, other
/// branches (a family's other sequences, a request's own prompt text) differ.
pub(super) fn next_token(before: u64, branch: u64) -> u32 {
    (mix(before.wrapping_add(branch.wrapping_mul(0x9E37_79B9))) % 50_000) as u32
}

/// Request `index`'s prompt: the first `prefix_len` tokens of shared stream `prefix_id`, then
/// text of its own.
pub(super) fn prompt(spec: &SimRequest, index: usize) -> Seq {
    let mut seq = Seq::default();
    for j in 0..spec.prompt_len {
        let before = seq.content.last().copied().unwrap_or(0);
        let token = if j == 0 && spec.prefix_len > 0 {
            1 + spec.prefix_id
        } else if j < spec.prefix_len {
            next_token(before, 0)
        } else {
            next_token(before, 1000 + index as u64)
        };
        seq.push(token);
    }
    seq
}

impl Seq {
    /// Appends a token and its content.
    pub(super) fn push(&mut self, token: u32) {
        let before = self.content.last().copied().unwrap_or(0);
        self.tokens.push(token);
        self.content.push(content(before, token));
        self.known = self.tokens.len();
    }
}

/// What every cell holds (0: never written).
pub(super) struct Cells(pub(super) Vec<u64>);

impl Cells {
    /// Writes `seq`'s contents at positions `from..to` (its K/V computed or copied back).
    pub(super) fn write(&mut self, pool: &KvPool, seq: &Seq, from: usize, to: usize) {
        for (slot, &c) in pool
            .slot_mapping(seq.id, from, to - from)
            .expect("reserved")
            .iter()
            .zip(&seq.content[from..to])
        {
            self.0[*slot] = c;
        }
    }

    /// The runner's page copies.
    pub(super) fn copy(&mut self, page_size: usize, copies: &[(PageId, PageId)]) {
        for &(src, dst) in copies {
            let (src, dst) = (src as usize * page_size, dst as usize * page_size);
            self.0.copy_within(src..src + page_size, dst);
        }
    }

    /// The first position of `0..to` where `seq` reads other K/V than its own, if any.
    pub(super) fn wrong_at(&self, pool: &KvPool, seq: &Seq, to: usize) -> Option<usize> {
        let slots = pool.slot_mapping(seq.id, 0, to).ok()?;
        (0..to).find(|&j| self.0[slots[j]] != seq.content[j])
    }
}

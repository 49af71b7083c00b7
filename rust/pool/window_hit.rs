//! Prefix hits in a pool whose sequences slide ([`KvPool::set_window`]): every layer's row reads
//! only the last `window` positions of its sequence, so a sequence resumed at position `h`
//! needs the pages of positions `h + 1 - window .. h` and no earlier ones (they were released:
//! `release_before`). A hit is then the longest `h` (whole pages) whose window pages are all
//! registered, found by their keys from the token ids alone: the pages before them may have been
//! evicted, which a released page, with no cached successor while its sequence runs, is early.
//!
//! ```text
//!   window 6, page_size 4, tokens of 6 pages:   page  0  1  2  3  4  5
//!                                               found -  -  y  y  y  -
//!   h = 16 (pages 0-3): reads positions 11..16 -> pages 2, 3: both found: a hit of 16 tokens,
//!   the sequence holding pages 2 and 3 with pages 0 and 1 released; h = 20 reads pages 3, 4:
//!   found too, so the hit is 20, holding pages 3 and 4 (page 5 is not found)
//! ```

use super::page_key::{chain_key, PageKey};
use super::token_chain::{Link, TokenChain};
use super::{KvPool, PrefixHit};
use crate::ids::SeqId;

impl KvPool {
    /// Every sequence of this pool attends, in every layer, over its last `window` positions
    /// only, and gives back its pages behind them (`release_before`): prefix hits then need
    /// only the pages of the window before the position they resume at (the module doc), and
    /// the prefix cache keeps a page findable when its parent's registration goes
    /// (`cached_pages.rs`, orphans). Call it on a fresh pool.
    ///
    /// ```
    /// # use kvpark_core::KvPool;
    /// let mut pool = KvPool::with_prefix_cache(4 * 8, 4, 7).unwrap();
    /// pool.set_window(6);
    /// let tokens: Vec<u32> = (0..20).collect();
    /// pool.add_sequence(1).unwrap();
    /// pool.reserve(1, 20).unwrap();
    /// pool.register_tokens(1, &tokens).unwrap();
    /// pool.free_sequence(1).unwrap(); // five pages cached
    /// pool.add_sequence(2).unwrap();
    /// assert_eq!(pool.match_prefix(2, &tokens, 19).unwrap(), 16);
    /// assert_eq!(pool.released_cells(2).unwrap(), 8); // it holds positions 8..16 only
    /// pool.check_integrity().unwrap();
    /// ```
    pub fn set_window(&mut self, window: usize) {
        assert!(window > 0, "a window of no positions");
        self.window = Some(window);
        if let Some(cache) = self.pages.cache.as_mut() {
            cache.orphans = true;
        }
    }

    /// The window of [`set_window`](Self::set_window), if any.
    pub fn window(&self) -> Option<usize> {
        self.window
    }

    /// The longest window hit in `tokens[..max_tokens]` whose first page's parent key is
    /// `root`: the hit, the links of its pages (those before its window may be `None`), and
    /// the first page it needs.
    pub(super) fn window_hit(
        &self,
        tokens: &[u32],
        max_tokens: usize,
        root: PageKey,
        window: usize,
    ) -> (PrefixHit, Vec<Link>, usize) {
        let ps = self.page_size();
        let Some(cache) = &self.pages.cache else {
            return (PrefixHit::default(), Vec::new(), 0);
        };
        let n_pages = tokens.len().min(max_tokens) / ps;
        let mut links = Vec::with_capacity(n_pages);
        let (mut parent_key, mut run) = (root, 0); // run: first page of the found run
        let (mut best, mut best_first) = (0, 0);
        for (i, page_tokens) in tokens.chunks_exact(ps).take(n_pages).enumerate() {
            let key = chain_key(parent_key, cache.salt, page_tokens);
            // orphans: found by the key, the parent key and its own tokens
            let found = cache.find(key, parent_key, None, page_tokens);
            links.push(Link { key, page: found });
            if found.is_none() {
                run = i + 1;
            } else {
                let first = ((i + 1) * ps + 1).saturating_sub(window) / ps;
                if run <= first {
                    (best, best_first) = (i + 1, first);
                }
            }
            parent_key = key;
        }
        links.truncate(best);
        let cached = links[best_first..]
            .iter()
            .filter(|l| l.page.is_some_and(|r| cache.is_cached(r.page)))
            .count();
        let hit = PrefixHit {
            tokens: best * ps,
            cached_cells: cached * ps,
        };
        (hit, links, best_first)
    }

    /// `match_prefix` in a sliding pool: attaches the window pages of the longest window hit to
    /// empty sequence `seq` (its earlier positions released) and returns the tokens covered.
    pub(super) fn attach_window_hit(
        &mut self,
        seq: SeqId,
        tokens: &[u32],
        max_tokens: usize,
        root: PageKey,
    ) -> usize {
        let window = self.window.expect("a sliding pool");
        let (hit, links, first) = self.window_hit(tokens, max_tokens, root, window);
        if hit.tokens == 0 {
            return 0;
        }
        let table = self.tables.get_mut(&seq).expect("match_prefix checked it");
        for link in &links[first..] {
            let page = link.page.expect("a hit's window pages are registered").page;
            self.pages.retain(page);
            table.pages.push(page);
        }
        table.released = first;
        table.len = hit.tokens;
        let chain = TokenChain {
            root,
            tokens: tokens[..hit.tokens].to_vec(),
            links,
        };
        self.chains.insert(seq, chain);
        hit.tokens
    }
}

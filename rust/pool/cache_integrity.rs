//! The prefix cache's invariants, checked by [`KvPool::check_integrity`] in O(pool).

use std::collections::{BTreeSet, HashSet};

use super::cached_pages::CachedPages;
use super::page_key::chain_key;
use super::KvPool;

impl KvPool {
    /// The first broken invariant of: with the cache off, nothing registered; each registered
    /// page holds `page_size` tokens, is under its own key in `by_key` and nowhere else (hash
    /// -> page one-to-one), its key is the hash of its parent key, the salt and its tokens, its
    /// parent is registered, with that key, an older serial and it among its successors; it is cached exactly when no
    /// table holds it, and never on the free list; the cached count, each page's count of
    /// cached successors and the set of evictable leaves match a recount; a registered page is
    /// full in every table holding it; each sequence's chain has one link per full page of its
    /// registered tokens (no more tokens than cells), with keys that recompute, and every live
    /// link names a page holding exactly those tokens.
    pub(super) fn check_prefix_cache(&self) -> Result<(), String> {
        let Some(cache) = &self.pages.cache else {
            return match self.chains.keys().next() {
                Some(seq) => Err(format!("cache off, but sequence {seq} has a token chain")),
                None => Ok(()),
            };
        };
        self.check_entries(cache)?;
        self.check_lru(cache)?;
        self.check_chains(cache)
    }

    fn check_entries(&self, cache: &CachedPages) -> Result<(), String> {
        let ps = self.page_size();
        let free: HashSet<u32> = self.pages.free.iter().copied().collect();
        let mut serials = HashSet::new();
        let mut registered = 0;
        for (p, e) in cache.entries.iter().enumerate() {
            let Some(e) = e else { continue };
            registered += 1;
            let page = p as u32;
            if e.tokens.len() != ps {
                return Err(format!(
                    "page {p} is registered with {} tokens",
                    e.tokens.len()
                ));
            }
            if cache.by_key.get(&e.key) != Some(&page) {
                return Err(format!("page {p}'s key does not lead back to it"));
            }
            if e.key != chain_key(e.parent_key, cache.salt, &e.tokens) {
                return Err(format!(
                    "page {p}'s key is not the hash of its parent and tokens"
                ));
            }
            if e.serial >= cache.next_serial || !serials.insert(e.serial) {
                return Err(format!("page {p}'s serial {} is not unique", e.serial));
            }
            // A first page's parent key is its cache salt's root: any key.
            match e.parent {
                None => {}
                Some(r) => match cache.entry(r.page).filter(|_| cache.alive(r)) {
                    // an orphan: its parent's registration went before it (a window's pool)
                    None if cache.orphans => {}
                    None => return Err(format!("page {p}'s parent registration is gone")),
                    Some(parent) => {
                        if parent.key != e.parent_key || r.serial >= e.serial {
                            return Err(format!("page {p}'s parent {} does not match", r.page));
                        }
                        if !parent.successors.contains(&page) {
                            return Err(format!("page {p} is not among its parent's successors"));
                        }
                    }
                },
            }
            for &s in &e.successors {
                let back = cache.entry(s).and_then(|se| se.parent);
                if back.map(|r| (r.page, r.serial)) != Some((page, e.serial)) {
                    return Err(format!("page {p} lists {s} as a successor, not its parent"));
                }
            }
            let held = self.pages.refcount(page) > 0;
            if e.cached == held {
                return Err(format!(
                    "page {p} is registered, held {held}, but cached {}",
                    e.cached
                ));
            }
            if free.contains(&page) {
                return Err(format!("registered page {p} is on the free list"));
            }
        }
        if cache.by_key.len() != registered {
            return Err(format!(
                "{} keys for {registered} registered pages: hash -> page is not one-to-one",
                cache.by_key.len()
            ));
        }
        Ok(())
    }

    fn check_lru(&self, cache: &CachedPages) -> Result<(), String> {
        let n = cache.entries.len();
        let mut children = vec![0u32; n];
        let mut cached = 0;
        for e in cache.entries.iter().flatten().filter(|e| e.cached) {
            cached += 1;
            if e.cached_at >= cache.clock {
                return Err(format!("a page was cached at {} >= clock", e.cached_at));
            }
            if let Some(r) = e.parent.filter(|&r| cache.alive(r)) {
                children[r.page as usize] += 1;
            }
        }
        if cached != cache.n_cached {
            return Err(format!(
                "{} cached pages counted, {cached} found",
                cache.n_cached
            ));
        }
        let mut leaves = BTreeSet::new();
        for (p, e) in cache.entries.iter().enumerate() {
            let Some(e) = e else { continue };
            if e.cached_children != children[p] {
                return Err(format!(
                    "page {p} counts {} cached successors, {} found",
                    e.cached_children, children[p]
                ));
            }
            if e.cached && children[p] == 0 {
                leaves.insert((e.cached_at, p as u32));
            }
        }
        if leaves != cache.leaves {
            return Err(
                "the evictable leaves are not the cached pages without a cached \
                        successor"
                    .to_string(),
            );
        }
        Ok(())
    }

    fn check_chains(&self, cache: &CachedPages) -> Result<(), String> {
        let ps = self.page_size();
        for (seq, table) in &self.tables {
            for (i, &page) in table.pages.iter().enumerate() {
                if cache.is_registered(page) && table.len < (table.released + i + 1) * ps {
                    return Err(format!(
                        "registered page {page} is partly used by sequence {seq}"
                    ));
                }
            }
        }
        for (seq, chain) in &self.chains {
            let Some(table) = self.tables.get(seq) else {
                return Err(format!("token chain of unknown sequence {seq}"));
            };
            if chain.tokens.len() > table.len {
                return Err(format!(
                    "sequence {seq} registered {} tokens in {} cells",
                    chain.tokens.len(),
                    table.len
                ));
            }
            if chain.links.len() != chain.tokens.len() / ps {
                return Err(format!("sequence {seq} has a link per page wrong"));
            }
            let mut parent_key = chain.root;
            for (link, tokens) in chain.links.iter().zip(chain.tokens.chunks_exact(ps)) {
                if link.key != chain_key(parent_key, cache.salt, tokens) {
                    return Err(format!("sequence {seq}'s chain keys do not recompute"));
                }
                if let Some(r) = link.page.filter(|&r| cache.alive(r)) {
                    if *cache.entry(r.page).expect("alive").tokens != *tokens {
                        return Err(format!(
                            "sequence {seq} links page {} holding other tokens",
                            r.page
                        ));
                    }
                }
                parent_key = link.key;
            }
        }
        Ok(())
    }
}

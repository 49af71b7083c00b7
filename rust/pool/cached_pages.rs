//! The index of registered full pages: key -> page, each page's parent and token ids, and the
//! cached ones (held by no sequence) in eviction order.
//!
//! ```text
//!   registered page    key   parent    tokens      ref count  state
//!        4             k0    (root)    [5 9 2 7]       1      held
//!        1             k1    page 4    [3 3 8 1]       0      cached (successor of 4)
//!        6             k2    page 1    [0 4 4 6]       0      cached, a leaf: evicted first
//!   by_key {k0: 4, k1: 1, k2: 6}        leaves (LRU first) [(t, 6)]
//! ```
//!
//! A page's parent is named by [`PageRef`]: the page id plus the serial number of that
//! registration. Serials are never reused, so a parent that was evicted (or replaced) and whose
//! page now holds something else is recognised as gone: a lookup checks the parent, the parent
//! key and the token ids of every page it walks, so `by_key` is one-to-one and a 64-bit
//! collision costs a miss, never wrong K/V.
//!
//! Eviction is LRU among the *leaves*: cached pages none of whose registered successors is
//! cached. A cached page with a cached successor waits until that successor has gone, so a
//! chain is eaten from its end and its start (the most shared part) stays findable longest.
//! A page leaving the index takes its registered successors with it (they could never be
//! reached again: a lookup walks from the first page): held ones stay held, unregistered, and
//! cached ones are freed (`allocator.rs`). So every registered page's parent is registered.
//!
//! Except in a pool whose sequences slide (`KvPool::set_window`): a hit there needs only the
//! pages of its last window, found by key from the token ids alone, so a page outlives its
//! parent's registration (an *orphan*). Its lookup then checks the parent key and its own
//! token ids, not the parent registration: a 64-bit collision of a whole prefix's key with the
//! same page of tokens could give wrong K/V, where the strict check costs a miss.

use std::collections::{BTreeSet, HashMap};

use super::page_key::PageKey;
use crate::ids::PageId;

/// A registration's serial number, unique over the pool's life (until `reset`).
pub(crate) type Serial = u64;

/// One registration of a page: alive while `entries[page]` still has this serial.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct PageRef {
    pub(crate) page: PageId,
    pub(crate) serial: Serial,
}

/// What the index knows of a registered page.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Registered {
    pub(crate) key: PageKey,
    pub(crate) serial: Serial,
    /// The key of the page before it (`ROOT_KEY` for a first page).
    pub(crate) parent_key: PageKey,
    /// The registration of the page before it; `None` for a sequence's first page.
    pub(crate) parent: Option<PageRef>,
    /// Its `page_size` token ids.
    pub(crate) tokens: Box<[u32]>,
    /// Held by no sequence (ref count 0) and findable.
    pub(crate) cached: bool,
    /// Cached pages whose parent is this registration.
    pub(crate) cached_children: u32,
    /// The clock when it last became cached: the LRU order.
    pub(crate) cached_at: u64,
    /// Its registered successors (pages whose parent is this registration).
    pub(crate) successors: Vec<PageId>,
}

/// The index of registered pages; lives in the allocator, which calls it on every ref count
/// change to or from 0.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct CachedPages {
    pub(crate) salt: u64,
    /// Per page: its registration, if any.
    pub(crate) entries: Vec<Option<Registered>>,
    pub(crate) by_key: HashMap<PageKey, PageId>,
    /// The evictable pages: cached, no cached successor; `(cached_at, page)`, oldest first.
    pub(crate) leaves: BTreeSet<(u64, PageId)>,
    pub(crate) n_cached: usize,
    pub(crate) next_serial: Serial,
    pub(crate) clock: u64,
    /// A page keeps its registration when its parent's goes (a sliding window's pool).
    pub(crate) orphans: bool,
}

impl CachedPages {
    pub(crate) fn new(n_pages: usize, salt: u64) -> Self {
        Self {
            salt,
            entries: vec![None; n_pages],
            by_key: HashMap::new(),
            leaves: BTreeSet::new(),
            n_cached: 0,
            next_serial: 1,
            clock: 0,
            orphans: false,
        }
    }

    /// Nothing registered, nothing cached (the salt and the orphans rule stay).
    pub(crate) fn reset(&mut self) {
        let (n_pages, salt, orphans) = (self.entries.len(), self.salt, self.orphans);
        *self = Self::new(n_pages, salt);
        self.orphans = orphans;
    }

    pub(crate) fn entry(&self, page: PageId) -> Option<&Registered> {
        self.entries[page as usize].as_ref()
    }

    pub(crate) fn is_registered(&self, page: PageId) -> bool {
        self.entries[page as usize].is_some()
    }

    pub(crate) fn is_cached(&self, page: PageId) -> bool {
        self.entry(page).is_some_and(|e| e.cached)
    }

    /// Whether this registration still stands.
    pub(crate) fn alive(&self, r: PageRef) -> bool {
        self.entry(r.page).is_some_and(|e| e.serial == r.serial)
    }

    /// The registration of the page holding `tokens` after `parent` (`None`: a first page),
    /// whose key is `key` and whose parent's key is `parent_key`: found by key, then checked
    /// in full.
    pub(crate) fn find(
        &self,
        key: PageKey,
        parent_key: PageKey,
        parent: Option<PageRef>,
        tokens: &[u32],
    ) -> Option<PageRef> {
        let &page = self.by_key.get(&key)?;
        let e = self.entry(page)?;
        // with orphans, the parent registration may be gone: its key and the tokens decide
        let same = e.parent_key == parent_key
            && (self.orphans || e.parent == parent)
            && *e.tokens == *tokens;
        same.then_some(PageRef {
            page,
            serial: e.serial,
        })
    }

    /// Registers held page `page` under `key`.
    /// note: call only if `page` is held and unregistered and `key` is not in the index.
    pub(crate) fn register(
        &mut self,
        page: PageId,
        key: PageKey,
        parent_key: PageKey,
        parent: Option<PageRef>,
        tokens: &[u32],
    ) -> PageRef {
        debug_assert!(!self.is_registered(page), "page {page} registered twice");
        debug_assert!(!self.by_key.contains_key(&key), "key of page {page} taken");
        let serial = self.next_serial;
        self.next_serial += 1;
        self.entries[page as usize] = Some(Registered {
            key,
            serial,
            parent_key,
            parent,
            tokens: tokens.into(),
            cached: false,
            cached_children: 0,
            cached_at: 0,
            successors: Vec::new(),
        });
        self.by_key.insert(key, page);
        if let Some(p) = parent {
            debug_assert!(self.alive(p), "page {page} registered on a dead parent");
            let pe = self.entries[p.page as usize].as_mut().expect("alive");
            pe.successors.push(page);
        }
        PageRef { page, serial }
    }

    /// Registered `page` lost its last holder: it is cached, the newest in LRU order.
    /// note: call only if `page` is registered and its ref count just became 0.
    pub(crate) fn enter(&mut self, page: PageId) {
        let now = self.clock;
        self.clock += 1;
        let e = self.entries[page as usize]
            .as_mut()
            .expect("enter: unregistered");
        debug_assert!(!e.cached, "page {page} cached twice");
        e.cached = true;
        e.cached_at = now;
        let (leaf, parent) = (e.cached_children == 0, e.parent);
        if leaf {
            self.leaves.insert((now, page));
        }
        self.n_cached += 1;
        if let Some(p) = parent.filter(|&p| self.alive(p)) {
            let pe = self.entries[p.page as usize].as_mut().expect("alive");
            pe.cached_children += 1;
            if pe.cached && pe.cached_children == 1 {
                let key = (pe.cached_at, p.page);
                self.leaves.remove(&key);
            }
        }
    }

    /// Cached `page` is taken by a sequence again (or is about to be unregistered): it leaves
    /// the LRU, and its parent may become a leaf.
    /// note: call only if `page` is cached.
    pub(crate) fn leave(&mut self, page: PageId) {
        let e = self.entries[page as usize]
            .as_mut()
            .expect("leave: unregistered");
        debug_assert!(e.cached, "page {page} is not cached");
        e.cached = false;
        let (key, parent) = ((e.cached_at, page), e.parent);
        self.leaves.remove(&key);
        self.n_cached -= 1;
        if let Some(p) = parent.filter(|&p| self.alive(p)) {
            let pe = self.entries[p.page as usize].as_mut().expect("alive");
            pe.cached_children -= 1;
            if pe.cached && pe.cached_children == 0 {
                let key = (pe.cached_at, p.page);
                self.leaves.insert(key);
            }
        }
    }

    /// Drops the registration of `page` and of all its registered successors (with orphans: of
    /// `page` alone), and returns the pages that were cached (now neither registered nor held:
    /// the caller frees them).
    pub(crate) fn unregister(&mut self, page: PageId) -> Vec<PageId> {
        let mut uncached = Vec::new();
        let mut stack = vec![page];
        while let Some(page) = stack.pop() {
            if self.is_cached(page) {
                self.leave(page);
                uncached.push(page);
            }
            let Some(e) = self.entries[page as usize].take() else {
                continue;
            };
            self.by_key.remove(&e.key);
            if let Some(p) = e.parent.filter(|&p| self.alive(p)) {
                let pe = self.entries[p.page as usize].as_mut().expect("alive");
                pe.successors.retain(|&s| s != page);
            }
            if self.orphans {
                continue; // they stay findable by key: orphans from now on
            }
            // Reversed, so that successors are freed in the order they were registered.
            stack.extend(e.successors.iter().rev());
        }
        uncached
    }

    /// The page eviction takes next: the least recently cached leaf.
    pub(crate) fn next_victim(&self) -> Option<PageId> {
        self.leaves.first().map(|&(_, page)| page)
    }
}

//! Ref counts, the free list and the cached pages: the page-level bookkeeping under
//! [`KvPool`](super::KvPool).
//!
//! A page is in exactly one of three states:
//!
//! ```text
//!   held    ref count > 0: in at least one page table
//!   cached  ref count 0, registered (prefix cache on): findable by key until evicted
//!   free    ref count 0, on the free list
//! ```
//!
//! Allocation takes the free list first (a LIFO stack), then evicts the least recently cached
//! leaf (`cached_pages.rs`); releasing the last holder of a registered page caches it instead of
//! freeing it. With the prefix cache off nothing is ever registered, so the allocator is the
//! plain ref count + LIFO free list it always was, with the same allocation order.

use super::cached_pages::CachedPages;
use crate::error::{KvError, KvResult};
use crate::ids::PageId;

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PageAllocator {
    pub(super) page_size: usize,
    /// Ref count per page: how many page tables hold it. 0 exactly when free or cached.
    pub(super) refcounts: Vec<u32>,
    /// Free pages; the last one is handed out next.
    pub(super) free: Vec<PageId>,
    /// The registered pages; `None` with the prefix cache off.
    pub(super) cache: Option<CachedPages>,
}

impl PageAllocator {
    pub(super) fn new(n_pages: usize, page_size: usize, salt: Option<u64>) -> Self {
        let mut allocator = Self {
            page_size,
            refcounts: vec![0; n_pages],
            free: Vec::with_capacity(n_pages),
            cache: salt.map(|salt| CachedPages::new(n_pages, salt)),
        };
        allocator.reset();
        allocator
    }

    /// Every page free, nothing cached; page 0 is handed out first.
    pub(super) fn reset(&mut self) {
        self.refcounts.fill(0);
        self.free.clear();
        // n_pages <= 2**32 was checked by `KvPool::new`, so every index fits a PageId.
        self.free
            .extend((0..self.refcounts.len()).rev().map(|p| p as PageId));
        if let Some(cache) = &mut self.cache {
            cache.reset();
        }
    }

    pub(crate) fn page_size(&self) -> usize {
        self.page_size
    }

    pub(crate) fn n_pages(&self) -> usize {
        self.refcounts.len()
    }

    /// Pages an allocation can take: free plus cached.
    pub(crate) fn free_pages(&self) -> usize {
        self.free.len() + self.cached_pages()
    }

    /// Pages held by no sequence but still findable by key.
    pub(crate) fn cached_pages(&self) -> usize {
        self.cache.as_ref().map_or(0, |c| c.n_cached)
    }

    pub(crate) fn used_pages(&self) -> usize {
        self.n_pages() - self.free_pages()
    }

    /// Ref count of `page`.
    /// note: call only if `page < n_pages`.
    pub(crate) fn refcount(&self, page: PageId) -> u32 {
        self.refcounts[page as usize]
    }

    /// Whether `page` is registered (findable by key, held or cached).
    pub(crate) fn is_registered(&self, page: PageId) -> bool {
        self.cache.as_ref().is_some_and(|c| c.is_registered(page))
    }

    /// `Ok` if `needed` pages are free or cached, else the `PoolFull` error to return unchanged.
    pub(crate) fn ensure_free(&self, needed: usize) -> KvResult<()> {
        let free = self.free_pages();
        if needed <= free {
            Ok(())
        } else {
            Err(KvError::PoolFull {
                needed,
                free,
                page_size: self.page_size,
            })
        }
    }

    /// Takes the next free page, else evicts the least recently cached leaf; ref count 1.
    /// note: call only if a page is free or cached (`ensure_free(1)` passed).
    pub(crate) fn alloc(&mut self) -> PageId {
        let page = match self.free.pop() {
            Some(page) => page,
            None => {
                let cache = self.cache.as_mut().expect("alloc: no free or cached page");
                let page = cache.next_victim().expect("alloc: no free or cached page");
                // Its registered successors go with it; any of them cached (a chain that ran on
                // through a held copy) are freed, and handed out next.
                let uncached = cache.unregister(page);
                debug_assert_eq!(uncached.first(), Some(&page));
                self.free.extend(uncached[1..].iter().rev());
                page
            }
        };
        debug_assert_eq!(self.refcounts[page as usize], 0, "free page {page} is held");
        self.refcounts[page as usize] = 1;
        page
    }

    /// One more page table holds `page`.
    /// note: call only if `page` is held, or cached (a prefix hit takes it out of the cache).
    pub(crate) fn retain(&mut self, page: PageId) {
        let count = &mut self.refcounts[page as usize];
        if *count == 0 {
            let cache = self.cache.as_mut().expect("retain of free page");
            debug_assert!(cache.is_cached(page), "retain of free page {page}");
            cache.leave(page);
        }
        *count += 1;
    }

    /// One page table fewer holds `page`; at ref count 0 it is cached if registered, else goes
    /// back on the free list. Returns whether it left every table.
    /// note: call only if `page` is held (ref count > 0).
    pub(crate) fn release(&mut self, page: PageId) -> bool {
        let count = &mut self.refcounts[page as usize];
        debug_assert!(*count > 0, "release of free page {page}");
        *count -= 1;
        if *count > 0 {
            return false;
        }
        match &mut self.cache {
            Some(cache) if cache.is_registered(page) => cache.enter(page),
            _ => self.free.push(page),
        }
        true
    }
}

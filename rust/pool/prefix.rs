//! The prefix cache's calls on [`KvPool`]: registration, prefix hits and the pure queries the
//! admission check and the planner read.
//!
//! The engine's side, in the order it calls them (docs/preemption.md, "Prefix cache: cached
//! pages"):
//!
//! 1. **Admit** a new sequence: [`cells_to_admit`](KvPool::cells_to_admit) (pure) says how
//!    much room it takes after its hit; then `add_sequence`, then
//!    [`match_prefix`](KvPool::match_prefix)`(seq, prompt, len(prompt) - 1)`, which puts the
//!    longest chain of whole cached pages matching the prompt into its page table and returns
//!    the tokens covered; only the rest of the prompt is computed (the last prompt token always
//!    is, since its row gives the first logits).
//! 2. **After each step**, once K/V are written, [`register_tokens`](KvPool::register_tokens)
//!    (or `register_step` for all sequences at once) with the token ids of the rows just
//!    computed, prompt or decoded alike: every page that becomes full is registered.
//! 3. **Release** as always (`free_sequence`, `truncate`, a park): a registered page whose last
//!    holder lets go is cached, findable until its room is needed.
//!
//! A registered page's content never changes: it is full in every table holding it (appends
//! only write a partly used tail), and `truncate` into one gives the sequence a copy instead
//! (copy-on-write), so the registered page stays as it was, held or cached.

use super::page_key::{chain_key, root_key, PageKey, ROOT_KEY};
use super::token_chain::{Link, TokenChain};
use super::{cached_pages::CachedPages, cached_pages::PageRef, KvPool, PageAllocator};
use crate::error::{KvError, KvResult};
use crate::ids::{PageId, SeqId};
use crate::page_table::pages_for;

/// What the cache holds of a token sequence's start: the answer of
/// [`cached_prefix`](KvPool::cached_prefix).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixHit {
    /// Tokens covered: whole pages from the start.
    pub tokens: usize,
    /// Cells of those pages held by no sequence now: attaching them moves them from cached to
    /// used, so they cost room as a fresh page would; pages another sequence holds cost none.
    pub cached_cells: usize,
}

/// The links of the longest chain of registered pages matching the start of
/// `tokens[..max_tokens]`, whole pages only, from first-page parent key `root`.
fn walk(
    cache: &CachedPages,
    page_size: usize,
    root: PageKey,
    tokens: &[u32],
    max_tokens: usize,
) -> Vec<Link> {
    let n_pages = tokens.len().min(max_tokens) / page_size;
    let mut links = Vec::new();
    let (mut parent_key, mut parent) = (root, None);
    for page_tokens in tokens.chunks_exact(page_size).take(n_pages) {
        let key = chain_key(parent_key, cache.salt, page_tokens);
        let Some(found) = cache.find(key, parent_key, parent, page_tokens) else {
            break;
        };
        links.push(Link {
            key,
            page: Some(found),
        });
        (parent_key, parent) = (key, Some(found));
    }
    links
}

impl PageAllocator {
    /// The registration for full page `own` of a sequence, holding `tokens` after `parent`:
    /// a registration of the same content if there is one (`own` itself, or another
    /// sequence's copy, and then `own` stays private), else `own`, newly registered. `None`
    /// if the key is taken by other content (a collision) or `own` is registered under
    /// another key (it was registered with other tokens): the chain breaks. The flag: `own`
    /// was newly registered.
    fn link_page(
        &mut self,
        own: PageId,
        key: PageKey,
        parent_key: PageKey,
        parent: Option<PageRef>,
        tokens: &[u32],
    ) -> (Option<PageRef>, bool) {
        let Some(cache) = &self.cache else {
            return (None, false);
        };
        if let Some(found) = cache.find(key, parent_key, parent, tokens) {
            return (Some(found), false);
        }
        if cache.by_key.contains_key(&key) || cache.is_registered(own) {
            return (None, false);
        }
        let cache = self.cache.as_mut().expect("checked above");
        (
            Some(cache.register(own, key, parent_key, parent, tokens)),
            true,
        )
    }
}

impl KvPool {
    /// A pool as [`new`](Self::new) makes it, with the prefix cache on. `salt` stands for
    /// everything besides the token ids that changes K and V (the model, its dtype, exact
    /// mode's tiling): pages are only found under the salt they were registered with.
    ///
    /// ```
    /// # use kvpark_core::KvPool;
    /// let mut pool = KvPool::with_prefix_cache(64, 4, 7).unwrap();
    /// let prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9];
    /// pool.add_sequence(1).unwrap();
    /// pool.reserve(1, 9).unwrap(); // pages [0, 1, 2]
    /// assert_eq!(pool.register_tokens(1, &prompt).unwrap(), 2); // two full pages
    /// pool.free_sequence(1).unwrap();
    /// assert_eq!((pool.cells_cached(), pool.cells_used()), (8, 0)); // pages 0, 1 stay cached
    /// pool.add_sequence(2).unwrap();
    /// assert_eq!(pool.match_prefix(2, &prompt, prompt.len() - 1).unwrap(), 8);
    /// assert_eq!(pool.page_table(2).unwrap(), &[0, 1]);
    /// ```
    pub fn with_prefix_cache(n_cells: usize, page_size: usize, salt: u64) -> KvResult<Self> {
        Self::build(n_cells, page_size, Some(salt))
    }

    /// The prefix cache's salt; `None` when it is off.
    pub fn prefix_cache_salt(&self) -> Option<u64> {
        self.pages.cache.as_ref().map(|c| c.salt)
    }

    /// [`add_sequence`](Self::add_sequence) for a request with cache salt `cache_salt`: its
    /// pages are found only by sequences of the same salt, and it finds only theirs (0 is no
    /// salt: the same as `add_sequence`). Pass the same salt to
    /// [`cached_prefix_salted`](Self::cached_prefix_salted) and
    /// [`cells_to_admit_salted`](Self::cells_to_admit_salted) for its admission.
    ///
    /// ```
    /// # use kvpark_core::KvPool;
    /// let mut pool = KvPool::with_prefix_cache(64, 4, 7).unwrap();
    /// let prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9];
    /// pool.add_salted_sequence(1, 42).unwrap();
    /// pool.reserve(1, 9).unwrap();
    /// pool.register_tokens(1, &prompt).unwrap();
    /// pool.free_sequence(1).unwrap();
    /// assert_eq!(pool.cached_prefix(&prompt, 8).tokens, 0); // unsalted: no hit
    /// assert_eq!(pool.cached_prefix_salted(&prompt, 8, 43).tokens, 0);
    /// assert_eq!(pool.cached_prefix_salted(&prompt, 8, 42).tokens, 8);
    /// ```
    pub fn add_salted_sequence(&mut self, seq: SeqId, cache_salt: u64) -> KvResult<()> {
        self.add_sequence(seq)?;
        if self.pages.cache.is_some() && cache_salt != 0 {
            let chain = TokenChain {
                root: root_key(cache_salt),
                ..TokenChain::default()
            };
            self.chains.insert(seq, chain);
        }
        Ok(())
    }

    /// Tokens of sequence `seq` registered so far (0 with the prefix cache off).
    pub fn registered_len(&self, seq: SeqId) -> KvResult<usize> {
        self.table(seq)?;
        Ok(self.chains.get(&seq).map_or(0, |c| c.tokens.len()))
    }

    /// Tells the pool the token ids of sequence `seq`'s next cells, after a step has written
    /// their K and V: `tokens` continue what the sequence registered before (or what
    /// `match_prefix` covered). Every page this fills is registered, unless a page of the same
    /// content is registered already (two requests computed it at once): that one stays, and
    /// this sequence's copy stays private, freed rather than cached when released; its later
    /// pages still chain on and register. Returns the pages newly registered.
    ///
    /// Fails with [`KvError::OutOfRange`] if the registered tokens would pass `seq_len(seq)`.
    /// With the prefix cache off it checks the same and registers nothing.
    /// note: register only cells whose K and V are written: a registered page can be handed to
    /// another sequence at once.
    pub fn register_tokens(&mut self, seq: SeqId, tokens: &[u32]) -> KvResult<usize> {
        let page_size = self.page_size();
        let table = self.tables.get(&seq).ok_or(KvError::UnknownSequence(seq))?;
        let have = self.chains.get(&seq).map_or(0, |c| c.tokens.len());
        if have + tokens.len() > table.len {
            return Err(KvError::OutOfRange {
                seq,
                start: have,
                count: tokens.len(),
                len: table.len,
            });
        }
        let Some(salt) = self.prefix_cache_salt() else {
            return Ok(0);
        };
        let chain = self.chains.entry(seq).or_default();
        chain.tokens.extend_from_slice(tokens);
        let mut newly = 0;
        while chain.links.len() < chain.tokens.len() / page_size {
            let i = chain.links.len();
            let page_tokens = &chain.tokens[i * page_size..(i + 1) * page_size];
            let (parent_key, parent) = chain.parent();
            let key = chain_key(parent_key, salt, page_tokens);
            let cache = self.pages.cache.as_ref().expect("on");
            // A parent evicted since it was linked cannot be checked any more: a break.
            let parent = parent.filter(|p| p.map_or(true, |p| cache.alive(p)));
            let page = match (parent, i.checked_sub(table.released)) {
                (None, _) => None,
                (Some(parent), Some(held)) => {
                    let own = table.pages[held];
                    let (page, new) =
                        self.pages
                            .link_page(own, key, parent_key, parent, page_tokens);
                    newly += usize::from(new);
                    page
                }
                // a released page (a swap came back into its later pages only): the chain goes
                // on through a registration of the same content, else it breaks here
                (Some(parent), None) => cache.find(key, parent_key, parent, page_tokens),
            };
            chain.links.push(Link { key, page });
        }
        Ok(newly)
    }

    /// [`register_tokens`](Self::register_tokens) for every `(seq_ids[i], tokens[i])` in order,
    /// in one call per step; all or nothing: every item is checked before any is applied.
    /// Fails with [`KvError::RegisterMismatch`] if the lists differ in length. Returns the
    /// pages newly registered.
    pub fn register_step(&mut self, seq_ids: &[SeqId], tokens: &[Vec<u32>]) -> KvResult<usize> {
        if seq_ids.len() != tokens.len() {
            return Err(KvError::RegisterMismatch {
                seq_ids: seq_ids.len(),
                token_lists: tokens.len(),
            });
        }
        let mut pending: Vec<(SeqId, usize)> = Vec::new();
        for (&seq, list) in seq_ids.iter().zip(tokens) {
            let len = self.seq_len(seq)?;
            let start = match pending.iter_mut().find(|(s, _)| *s == seq) {
                Some((_, have)) => have,
                None => {
                    pending.push((seq, self.registered_len(seq)?));
                    &mut pending.last_mut().expect("pushed").1
                }
            };
            if *start + list.len() > len {
                let (start, count) = (*start, list.len());
                return Err(KvError::OutOfRange {
                    seq,
                    start,
                    count,
                    len,
                });
            }
            *start += list.len();
        }
        let mut newly = 0;
        for (&seq, list) in seq_ids.iter().zip(tokens) {
            newly += self.register_tokens(seq, list)?;
        }
        Ok(newly)
    }

    /// The longest chain of whole registered pages (held or cached) matching the start of
    /// `tokens[..max_tokens]`: pure, for the admission check and the planner's resume cost.
    /// Nothing with the prefix cache off.
    pub fn cached_prefix(&self, tokens: &[u32], max_tokens: usize) -> PrefixHit {
        self.cached_prefix_salted(tokens, max_tokens, 0)
    }

    /// [`cached_prefix`](Self::cached_prefix) among the pages of cache salt `cache_salt`.
    pub fn cached_prefix_salted(
        &self,
        tokens: &[u32],
        max_tokens: usize,
        cache_salt: u64,
    ) -> PrefixHit {
        let Some(cache) = &self.pages.cache else {
            return PrefixHit::default();
        };
        if let Some(window) = self.window {
            return self
                .window_hit(tokens, max_tokens, root_key(cache_salt), window)
                .0;
        }
        let links = walk(
            cache,
            self.page_size(),
            root_key(cache_salt),
            tokens,
            max_tokens,
        );
        let cached = links
            .iter()
            .filter(|l| l.page.is_some_and(|r| cache.is_cached(r.page)))
            .count();
        PrefixHit {
            tokens: links.len() * self.page_size(),
            cached_cells: cached * self.page_size(),
        }
    }

    /// The room (cells of free or cached pages) a new sequence holding `n_cells` cells takes
    /// after attaching its cached prefix of `tokens[..max_tokens]`: its pages beyond the hit,
    /// plus the hit's pages that are cached now. What admission checks against `cells_free()`
    /// and what a parked request's `resume_cells` should be (see docs/preemption.md). Without a
    /// hit: `n_cells` rounded up to whole pages.
    pub fn cells_to_admit(&self, tokens: &[u32], max_tokens: usize, n_cells: usize) -> usize {
        self.cells_to_admit_salted(tokens, max_tokens, n_cells, 0)
    }

    /// [`cells_to_admit`](Self::cells_to_admit) for a sequence of cache salt `cache_salt`.
    pub fn cells_to_admit_salted(
        &self,
        tokens: &[u32],
        max_tokens: usize,
        n_cells: usize,
        cache_salt: u64,
    ) -> usize {
        let hit = self.cached_prefix_salted(tokens, max_tokens.min(n_cells), cache_salt);
        pages_for(n_cells, self.page_size()) * self.page_size() - hit.tokens + hit.cached_cells
    }

    /// Attaches to empty sequence `seq` the longest chain of whole registered pages matching
    /// the start of `tokens[..max_tokens]`: they join its page table (ref count +1; a cached
    /// page leaves the cache), its length and registered tokens become the tokens covered, and
    /// the call returns that count (0: no hit, nothing changed). Takes no free page, so it
    /// never fails for room. Pass `max_tokens = len(tokens) - 1` for a prompt, so that its last
    /// token is computed; a swap resume passes its computed count. Only pages of the
    /// sequence's own cache salt are found (see [`add_salted_sequence`](Self::add_salted_sequence)).
    ///
    /// Fails with [`KvError::NotEmpty`] if `seq` holds cells. With the prefix cache off: 0.
    pub fn match_prefix(
        &mut self,
        seq: SeqId,
        tokens: &[u32],
        max_tokens: usize,
    ) -> KvResult<usize> {
        let page_size = self.page_size();
        let table = self
            .tables
            .get_mut(&seq)
            .ok_or(KvError::UnknownSequence(seq))?;
        if table.len > 0 {
            return Err(KvError::NotEmpty {
                seq,
                len: table.len,
            });
        }
        let Some(cache) = &self.pages.cache else {
            return Ok(0);
        };
        let root = self.chains.get(&seq).map_or(ROOT_KEY, |c| c.root);
        if self.window.is_some() {
            return Ok(self.attach_window_hit(seq, tokens, max_tokens, root));
        }
        let links = walk(cache, page_size, root, tokens, max_tokens);
        if links.is_empty() {
            return Ok(0);
        }
        for link in &links {
            let page = link.page.expect("a hit is registered").page;
            self.pages.retain(page);
            table.pages.push(page);
        }
        let covered = links.len() * page_size;
        table.len = covered;
        let chain = TokenChain {
            root,
            tokens: tokens[..covered].to_vec(),
            links,
        };
        self.chains.insert(seq, chain);
        Ok(covered)
    }

    /// The key of `page` if it is registered (held or cached). Fails with
    /// [`KvError::UnknownPage`] outside `0..n_pages`.
    pub fn page_key(&self, page: usize) -> KvResult<Option<u64>> {
        self.page_refcount(page)?;
        Ok(self
            .pages
            .cache
            .as_ref()
            .and_then(|c| c.entry(page as PageId))
            .map(|e| e.key))
    }

    /// The cached pages (held by no sequence, findable) in the order eviction would take them
    /// if nothing else changed: least recently cached leaf first. O(cached · log); for tests,
    /// `/slots`-style views and debugging.
    pub fn eviction_order(&self) -> Vec<PageId> {
        let Some(cache) = &self.pages.cache else {
            return Vec::new();
        };
        let mut cache = cache.clone();
        let mut order = Vec::with_capacity(cache.n_cached);
        while let Some(page) = cache.next_victim() {
            order.extend(cache.unregister(page));
        }
        order
    }
}

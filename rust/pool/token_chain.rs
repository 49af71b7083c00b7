//! What one sequence has registered: its token ids so far and, per full page, the page's key
//! and the registration that holds that content.
//!
//! ```text
//!   seq 7, page_size 4, 10 tokens registered, page table [4, 9, 2]
//!   tokens  [5 9 2 7 | 3 3 8 1 | 0 4]        the last 2: its partly used tail, not a page yet
//!   links   [k0 -> page 4 | k1 -> page 6]    page 9 is a private copy of page 6's content:
//!                                            computed at the same time as page 6 by another
//!                                            sequence, which registered it first
//! ```
//!
//! A link names the registration of the page's content, usually the sequence's own page. When
//! another sequence registered the same content first, the link names that page and the own
//! copy stays private (unregistered, freed rather than cached on release), but the next page
//! still chains on: its parent is the registration the link names. A link with no registration
//! is a break: a 64-bit collision took the key, or the registration it chained on was evicted
//! (a link is not updated then: `alive` says whether it still stands); nothing after a break
//! registers, since its parent could not be checked.

use super::cached_pages::PageRef;
use super::page_key::PageKey;

/// One full page of a sequence's chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Link {
    pub(crate) key: PageKey,
    /// The registration holding this content; `None`: the chain is broken here.
    pub(crate) page: Option<PageRef>,
}

/// One sequence's registered tokens and page chain: `links.len() == tokens.len() / page_size`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct TokenChain {
    /// The parent key of its first page: `root_key` of the sequence's cache salt.
    pub(crate) root: PageKey,
    pub(crate) tokens: Vec<u32>,
    pub(crate) links: Vec<Link>,
}

impl TokenChain {
    /// Keeps the first `n_tokens` registered tokens and the links of the pages they fill.
    pub(crate) fn truncate(&mut self, n_tokens: usize, page_size: usize) {
        self.tokens.truncate(n_tokens);
        self.links.truncate(self.tokens.len() / page_size);
    }

    /// The key and registration the next full page chains on: `(root, None)` for the first
    /// page; the registration is `None` after a break.
    pub(crate) fn parent(&self) -> (PageKey, Option<Option<PageRef>>) {
        match self.links.last() {
            None => (self.root, Some(None)),
            Some(link) => (link.key, link.page.map(Some)),
        }
    }
}

//! The content address of a full page: a hash chain over the token ids of the pages before it.
//!
//! ```text
//!   key(page 0) = H(ROOT,        salt, tokens[0 .. ps])
//!   key(page i) = H(key(page i-1), salt, tokens[i*ps .. (i+1)*ps])
//! ```
//!
//! The K and V of a cell depend on every token up to it, so two pages hold the same K and V
//! exactly when their whole token prefixes are equal: the chain makes that one 64-bit key. The
//! salt stands for everything else that changes K and V (the model, exact mode's tiling), so
//! pools of different models or tilings never share a key.
//!
//! A request's own cache salt (`cache_salt` on the API) goes in before the first page: its chain
//! starts from [`root_key`]`(cache_salt)` instead of `ROOT`, so requests of different salts
//! never find each other's pages, and requests of one salt share them as usual.
//!
//! The hash is deterministic (no per-process seed): the same tokens give the same key in every
//! run, which keeps allocation, eviction and the tests reproducible. 64 bits can collide, so the
//! key is only an index: `cached_pages.rs` stores each registered page's parent and token ids
//! and compares them on every lookup, so a collision costs a miss, never wrong K/V.

/// A full page's key in the hash chain.
pub(crate) type PageKey = u64;

/// The parent key of a sequence's first page.
pub(crate) const ROOT_KEY: PageKey = 0;

/// The parent key of the first page of a sequence whose cache salt is `cache_salt`: `ROOT_KEY`
/// for 0 (no salt), else a key that no other salt gives (`mix` is a bijection), never 0.
pub(crate) fn root_key(cache_salt: u64) -> PageKey {
    if cache_salt == 0 {
        return ROOT_KEY;
    }
    match mix(cache_salt ^ 0x7361_6C74) {
        // "salt"
        ROOT_KEY => 1,
        key => key,
    }
}

/// splitmix64's finaliser: a bijection of u64 that spreads every input bit over the output.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Folds one word into the running state. For a fixed state distinct words give distinct
/// states (`mix` is a bijection), so two pages collide only by chance, never by construction.
fn absorb(state: u64, word: u64) -> u64 {
    mix(state ^ word).wrapping_add(0x9E37_79B9_7F4A_7C15)
}

/// The key of a full page holding `tokens`, after the page whose key is `parent`.
pub(crate) fn chain_key(parent: PageKey, salt: u64, tokens: &[u32]) -> PageKey {
    let mut state = absorb(absorb(0x6B76_7061_726B, parent), salt); // "kvpark"
    state = absorb(state, tokens.len() as u64);
    for pair in tokens.chunks(2) {
        let hi = pair.get(1).map_or(u64::from(u32::MAX), |&t| u64::from(t));
        state = absorb(state, (hi << 32) | u64::from(pair[0]));
    }
    // Never ROOT_KEY, so that a page's key cannot pass for "no parent".
    if state == ROOT_KEY {
        1
    } else {
        state
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_tokens_after_the_same_parent_give_the_same_key() {
        assert_eq!(chain_key(7, 1, &[1, 2, 3]), chain_key(7, 1, &[1, 2, 3]));
    }

    #[test]
    fn parent_salt_order_and_length_all_change_the_key() {
        let base = chain_key(7, 1, &[1, 2, 3, 4]);
        assert_ne!(base, chain_key(8, 1, &[1, 2, 3, 4]));
        assert_ne!(base, chain_key(7, 2, &[1, 2, 3, 4]));
        assert_ne!(base, chain_key(7, 1, &[2, 1, 3, 4]));
        assert_ne!(base, chain_key(7, 1, &[1, 2, 3]));
        assert_ne!(chain_key(7, 1, &[5]), chain_key(7, 1, &[5, u32::MAX]));
    }

    #[test]
    fn each_cache_salt_has_its_own_root() {
        assert_eq!(root_key(0), ROOT_KEY);
        let roots: std::collections::HashSet<_> = (0..1000).map(root_key).collect();
        assert_eq!(roots.len(), 1000);
    }

    #[test]
    fn a_key_is_never_the_root_key() {
        for t in 0..1000 {
            assert_ne!(chain_key(ROOT_KEY, 0, &[t]), ROOT_KEY);
        }
    }
}

//! The BPE model of tokenizer.json (`"model": {"type": "BPE", ...}`) over byte-level
//! symbols: a pre-token's bytes in, its token ids out, merged exactly as Hugging Face
//! `tokenizers` merges (lowest merge rank first, leftmost on ties), with a per-word cache
//! because the same words come back in every prompt.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};
use std::hash::{BuildHasherDefault, Hash, Hasher};
use std::sync::RwLock;

/// Most words the cache keeps (then it stops adding, as `tokenizers` does: the
/// vocabulary's frequent words are in it by then).
const CACHE_CAPACITY: usize = 20_000;
/// The cache is split in shards by word hash so that requests tokenized on different
/// cores at once do not all take the same lock.
const CACHE_SHARDS: usize = 16;
/// Longer words are merged every time: they are rare and would crowd the cache.
const CACHE_MAX_WORD_BYTES: usize = 64;

/// FxHash (rustc's): the maps here are keyed by small ints and short words, where
/// SipHash's DoS resistance costs more than the lookup itself. Keys come from the
/// vocabulary (merges) or from text that the cache caps in size.
#[derive(Default, Clone, Copy)]
pub struct FxHasher {
    hash: u64,
}

const FX_SEED: u64 = 0x51_7c_c1_b7_27_22_0a_95;

impl FxHasher {
    #[inline]
    fn add(&mut self, word: u64) {
        self.hash = (self.hash.rotate_left(5) ^ word).wrapping_mul(FX_SEED);
    }
}

impl Hasher for FxHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for chunk in &mut chunks {
            let mut word = [0u8; 8];
            word.copy_from_slice(chunk);
            self.add(u64::from_le_bytes(word));
        }
        for &b in chunks.remainder() {
            self.add(u64::from(b));
        }
    }
    #[inline]
    fn write_u32(&mut self, n: u32) {
        self.add(u64::from(n));
    }
    #[inline]
    fn write_u64(&mut self, n: u64) {
        self.add(n);
    }
    #[inline]
    fn write_usize(&mut self, n: usize) {
        self.add(n as u64);
    }
    #[inline]
    fn finish(&self) -> u64 {
        self.hash
    }
}

pub type FxMap<K, V> = HashMap<K, V, BuildHasherDefault<FxHasher>>;

/// What the model needs, already resolved to ids by the loader.
pub struct BpeModel {
    /// Id of each byte's one-char token (None: not in the vocabulary).
    pub byte_ids: [Option<u32>; 256],
    /// (left id, right id) -> (rank, merged id); rank = position in the merges list.
    pub merges: FxMap<(u32, u32), (u32, u32)>,
    /// `unk_token`'s id: a byte without a token becomes it (None: the byte is dropped).
    pub unk_id: Option<u32>,
    pub fuse_unk: bool,
    /// `ignore_merges`: a word that is a token as a whole is that token (bytes -> id of
    /// every vocabulary token spelled in the byte alphabet); None when not set.
    pub whole_words: Option<FxMap<Box<[u8]>, u32>>,
}

type WordCache = RwLock<FxMap<Box<[u8]>, Box<[u32]>>>;

/// The model plus its word cache.
pub struct Bpe {
    model: BpeModel,
    cache: Vec<WordCache>,
}

/// One symbol of a word being merged; merged-away symbols keep `len == 0`.
#[derive(Clone, Copy)]
struct Symbol {
    id: u32,
    prev: i32,
    next: i32,
    len: u32,
}

/// A merge that may apply: ordered so that the heap pops the lowest rank, then the
/// leftmost position.
#[derive(PartialEq, Eq)]
struct Candidate {
    rank: u32,
    pos: u32,
    new_id: u32,
}

impl Ord for Candidate {
    fn cmp(&self, other: &Self) -> Ordering {
        other
            .rank
            .cmp(&self.rank)
            .then_with(|| other.pos.cmp(&self.pos))
    }
}

impl PartialOrd for Candidate {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Bpe {
    pub fn new(model: BpeModel) -> Bpe {
        let cache = (0..CACHE_SHARDS)
            .map(|_| RwLock::new(FxMap::default()))
            .collect();
        Bpe { model, cache }
    }

    /// Appends the ids of one pre-token (its UTF-8 bytes; each byte is one byte-level
    /// symbol) to `out`.
    pub fn encode_word(&self, word: &[u8], out: &mut Vec<u32>) {
        if word.is_empty() {
            return;
        }
        if word.len() > CACHE_MAX_WORD_BYTES {
            self.merge_word(word, out);
            return;
        }
        let mut hasher = FxHasher::default();
        word.hash(&mut hasher);
        let shard = &self.cache[hasher.finish() as usize % CACHE_SHARDS];
        if let Ok(cache) = shard.read() {
            if let Some(ids) = cache.get(word) {
                out.extend_from_slice(ids);
                return;
            }
        }
        let start = out.len();
        self.merge_word(word, out);
        if let Ok(mut cache) = shard.write() {
            if cache.len() < CACHE_CAPACITY / CACHE_SHARDS {
                cache.insert(word.into(), out[start..].into());
            }
        }
    }

    fn merge_word(&self, word: &[u8], out: &mut Vec<u32>) {
        if let Some(whole) = &self.model.whole_words {
            if let Some(&id) = whole.get(word) {
                out.push(id);
                return;
            }
        }
        let mut symbols = self.initial_symbols(word);
        if symbols.len() > 1 {
            self.merge_all(&mut symbols);
        }
        out.extend(symbols.iter().filter(|s| s.len > 0).map(|s| s.id));
    }

    /// One symbol per byte; bytes without a token become `unk` (runs fused when
    /// `fuse_unk`) or are dropped when there is no unk token (what `tokenizers` does).
    fn initial_symbols(&self, word: &[u8]) -> Vec<Symbol> {
        let mut ids: Vec<(u32, u32)> = Vec::with_capacity(word.len());
        let mut unk: Option<(u32, u32)> = None;
        for &b in word {
            match self.model.byte_ids[usize::from(b)] {
                Some(id) => {
                    if let Some(u) = unk.take() {
                        ids.push(u);
                    }
                    ids.push((id, 1));
                }
                None => {
                    if let Some(unk_id) = self.model.unk_id {
                        unk = match unk {
                            Some((u, n)) if self.model.fuse_unk => Some((u, n + 1)),
                            Some(u) => {
                                ids.push(u);
                                Some((unk_id, 1))
                            }
                            None => Some((unk_id, 1)),
                        };
                    }
                }
            }
        }
        if let Some(u) = unk {
            ids.push(u);
        }
        let n = ids.len() as i32;
        ids.iter()
            .enumerate()
            .map(|(i, &(id, len))| {
                let i = i as i32;
                Symbol {
                    id,
                    prev: i - 1,
                    next: if i + 1 < n { i + 1 } else { -1 },
                    len,
                }
            })
            .collect()
    }

    /// Applies merges until none applies, lowest rank first, leftmost on ties.
    fn merge_all(&self, symbols: &mut [Symbol]) {
        let merges = &self.model.merges;
        let mut heap = BinaryHeap::with_capacity(symbols.len());
        for pos in 0..symbols.len() - 1 {
            if let Some(&(rank, new_id)) = merges.get(&(symbols[pos].id, symbols[pos + 1].id)) {
                heap.push(Candidate {
                    rank,
                    pos: pos as u32,
                    new_id,
                });
            }
        }
        while let Some(top) = heap.pop() {
            let pos = top.pos as usize;
            let left = symbols[pos];
            if left.len == 0 || left.next < 0 {
                continue;
            }
            let next = left.next as usize;
            let right = symbols[next];
            // Stale candidate: one side merged since it was pushed.
            match merges.get(&(left.id, right.id)) {
                Some(&(_, new_id)) if new_id == top.new_id => {}
                _ => continue,
            }
            symbols[pos].id = top.new_id;
            symbols[pos].len += right.len;
            symbols[pos].next = right.next;
            symbols[next].len = 0;
            if right.next >= 0 {
                symbols[right.next as usize].prev = pos as i32;
            }
            let merged = symbols[pos];
            if merged.prev >= 0 {
                let prev = merged.prev as usize;
                if let Some(&(rank, new_id)) = merges.get(&(symbols[prev].id, merged.id)) {
                    heap.push(Candidate {
                        rank,
                        pos: prev as u32,
                        new_id,
                    });
                }
            }
            if merged.next >= 0 {
                let after = symbols[merged.next as usize];
                if let Some(&(rank, new_id)) = merges.get(&(merged.id, after.id)) {
                    heap.push(Candidate {
                        rank,
                        pos: pos as u32,
                        new_id,
                    });
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bytes a, b, c as ids 0, 1, 2; merges (a b)->3 rank 1, (b c)->4 rank 0,
    /// (a 4)->5 rank 2.
    fn toy() -> Bpe {
        let mut byte_ids = [None; 256];
        byte_ids[usize::from(b'a')] = Some(0);
        byte_ids[usize::from(b'b')] = Some(1);
        byte_ids[usize::from(b'c')] = Some(2);
        let mut merges = FxMap::default();
        merges.insert((0, 1), (1, 3));
        merges.insert((1, 2), (0, 4));
        merges.insert((0, 4), (2, 5));
        Bpe::new(BpeModel {
            byte_ids,
            merges,
            unk_id: None,
            fuse_unk: false,
            whole_words: None,
        })
    }

    fn encode(bpe: &Bpe, word: &str) -> Vec<u32> {
        let mut out = Vec::new();
        bpe.encode_word(word.as_bytes(), &mut out);
        out
    }

    #[test]
    fn lowest_rank_first_then_leftmost() {
        let bpe = toy();
        assert_eq!(encode(&bpe, "abc"), vec![5]); // (b c) before (a b), then (a bc)
        assert_eq!(encode(&bpe, "abab"), vec![3, 3]);
        assert_eq!(encode(&bpe, "abc"), vec![5]); // from the cache
    }

    #[test]
    fn bytes_without_a_token_are_dropped_without_unk() {
        let bpe = toy();
        // "x" has no token: a and b become neighbours and merge
        assert_eq!(encode(&bpe, "axb"), vec![3]);
    }
}

//! The prefix cache's entries: one per cached full block, keyed exactly by (parent entry,
//! the block's token ids), with the ordered sets eviction picks its victims from.
//!
//! This file knows entries and where they are, not the pool: removing or moving an entry
//! hands its old location back to the [`BlockManager`](super::BlockManager), which owns the
//! free lists and the transfers.

use std::collections::{BTreeSet, HashMap};

/// An entry's index in the slab. Reused only once its entry is gone, and an entry goes only
/// once it has no children, so a key never names a dead (or recycled) parent.
pub(super) type EntryId = u32;

/// Where a cached block's keys and values are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Location {
    /// In this pool block, ready for attention to read.
    Device(u32),
    /// In this host-tier slot: must be copied back into a pool block before use.
    Host(u32),
}

/// One cached full block.
#[derive(Debug)]
pub(super) struct Entry {
    /// The entry of the block before this one; `None` for a sequence's first block.
    pub(super) parent: Option<EntryId>,
    /// The block's token ids (the other half of its key; kept to remove the key).
    pub(super) tokens: Box<[u32]>,
    pub(super) location: Location,
    /// Running sequences whose tables hold this block: while any do it is never evicted.
    pub(super) pins: u32,
    /// Entries whose parent this is, in either tier: an entry goes only once this is 0.
    pub(super) children: u32,
    /// Those of them located on the device: eviction takes only device entries without
    /// any, so the pool-resident part of every chain stays a prefix of it.
    pub(super) device_children: u32,
    /// The logical clock's tick of the last hit or finish that used it (the LRU order).
    pub(super) last_used: u64,
}

impl Entry {
    /// Whether pool eviction may take it now: unpinned, on the device, no device child.
    fn device_candidate(&self) -> bool {
        self.pins == 0 && self.device_children == 0 && matches!(self.location, Location::Device(_))
    }

    /// Whether the host tier may drop it to make room: unpinned, on the host, no child at
    /// all (a dropped parent would leave its children unreachable).
    fn host_candidate(&self) -> bool {
        self.pins == 0 && self.children == 0 && matches!(self.location, Location::Host(_))
    }
}

/// An exact key: the parent entry and the block's token ids. No hash stands in for the
/// tokens, so two different prefixes can never share an entry.
type Key = (Option<EntryId>, Box<[u32]>);

/// The entries, their exact-key index and their eviction candidates.
///
/// Every change to a field that decides candidacy (`pins`, `children`, `device_children`,
/// `location`, `last_used`) goes through [`PrefixCache::update`], which takes the entry out
/// of the candidate sets and the counters before the change and puts it back after, so
/// they never drift from the entries ([`PrefixCache::check`] recounts them).
#[derive(Debug)]
pub(super) struct PrefixCache {
    block_size: usize,
    entries: Vec<Option<Entry>>,
    free_ids: Vec<EntryId>,
    index: HashMap<Key, EntryId>,
    /// A key reused by every lookup, so a lookup allocates nothing.
    probe: Key,
    /// Device entries eviction may take, oldest first.
    device_lru: BTreeSet<(u64, EntryId)>,
    /// Host entries the host tier may drop, oldest first.
    host_lru: BTreeSet<(u64, EntryId)>,
    clock: u64,
    device_entries: usize,
    device_pinned: usize,
    host_entries: usize,
}

impl PrefixCache {
    pub(super) fn new(block_size: usize) -> Self {
        PrefixCache {
            block_size,
            entries: Vec::new(),
            free_ids: Vec::new(),
            index: HashMap::new(),
            probe: (None, vec![0; block_size].into_boxed_slice()),
            device_lru: BTreeSet::new(),
            host_lru: BTreeSet::new(),
            clock: 0,
            device_entries: 0,
            device_pinned: 0,
            host_entries: 0,
        }
    }

    pub(super) fn get(&self, id: EntryId) -> &Entry {
        self.entries[id as usize]
            .as_ref()
            .unwrap_or_else(|| panic!("kv cache entry {id} is not live"))
    }

    /// The entry keyed by `parent` and `tokens` (one block's worth), if cached.
    pub(super) fn find(&mut self, parent: Option<EntryId>, tokens: &[u32]) -> Option<EntryId> {
        self.probe.0 = parent;
        self.probe.1.copy_from_slice(tokens);
        self.index.get(&self.probe).copied()
    }

    /// A new unpinned entry, used now.
    pub(super) fn insert(
        &mut self,
        parent: Option<EntryId>,
        tokens: &[u32],
        location: Location,
    ) -> EntryId {
        assert_eq!(
            tokens.len(),
            self.block_size,
            "a cache entry is one full block"
        );
        if let Some(p) = parent {
            let on_device = matches!(location, Location::Device(_));
            self.update(p, |e| {
                e.children += 1;
                e.device_children += u32::from(on_device);
            });
        }
        self.clock += 1;
        let entry = Entry {
            parent,
            tokens: tokens.into(),
            location,
            pins: 0,
            children: 0,
            device_children: 0,
            last_used: self.clock,
        };
        let key = (parent, entry.tokens.clone());
        let id = match self.free_ids.pop() {
            Some(id) => {
                self.entries[id as usize] = Some(entry);
                id
            }
            None => {
                let id = EntryId::try_from(self.entries.len()).expect("fewer than 2^32 entries");
                self.entries.push(Some(entry));
                id
            }
        };
        let previous = self.index.insert(key, id);
        assert!(previous.is_none(), "kv cache key inserted twice");
        self.list(id);
        id
    }

    /// Removes a childless entry, returning where it was (now the caller's to free).
    pub(super) fn remove(&mut self, id: EntryId) -> Location {
        self.unlist(id);
        let entry = self.entries[id as usize].take().expect("live entry");
        assert_eq!(
            entry.children, 0,
            "kv cache entry {id} removed before its children"
        );
        let removed = self.index.remove(&(entry.parent, entry.tokens));
        debug_assert_eq!(removed, Some(id));
        if let Some(p) = entry.parent {
            let on_device = matches!(entry.location, Location::Device(_));
            self.update(p, |e| {
                e.children -= 1;
                e.device_children -= u32::from(on_device);
            });
        }
        self.free_ids.push(id);
        entry.location
    }

    /// Records that the entry's block now lies at `location` (the caller copies it).
    pub(super) fn relocate(&mut self, id: EntryId, location: Location) {
        let entry = self.get(id);
        let was_on_device = matches!(entry.location, Location::Device(_));
        let on_device = matches!(location, Location::Device(_));
        if let Some(p) = entry.parent
            && was_on_device != on_device
        {
            self.update(p, |e| {
                if on_device {
                    e.device_children += 1;
                } else {
                    e.device_children -= 1;
                }
            });
        }
        self.update(id, |e| e.location = location);
    }

    /// A sequence starts using the entry: it cannot be evicted until unpinned.
    pub(super) fn pin(&mut self, id: EntryId) {
        self.touch(id);
        self.update(id, |e| e.pins += 1);
    }

    pub(super) fn unpin(&mut self, id: EntryId) {
        self.update(id, |e| {
            e.pins = e
                .pins
                .checked_sub(1)
                .expect("kv cache entry unpinned more than pinned");
        });
    }

    /// Marks the entry used now: it moves to the young end of the LRU order. Called along
    /// a chain from its root, the deeper blocks end up no older than the shallower.
    pub(super) fn touch(&mut self, id: EntryId) {
        self.clock += 1;
        let now = self.clock;
        self.update(id, |e| e.last_used = now);
    }

    /// The least recently used device entry eviction may take.
    pub(super) fn device_victim(&self) -> Option<EntryId> {
        self.device_lru.first().map(|&(_, id)| id)
    }

    /// The least recently used host entry the host tier may drop.
    pub(super) fn host_victim(&self) -> Option<EntryId> {
        self.host_lru.first().map(|&(_, id)| id)
    }

    /// Device entries eviction can free one by one: every unpinned one, since pins cover
    /// whole chains from the root (a pinned entry's ancestors are pinned too), so unpinned
    /// entries keep becoming device leaves as their children leave.
    pub(super) fn evictable(&self) -> usize {
        self.device_entries - self.device_pinned
    }

    /// Entries on the device, pinned ones included.
    pub(super) fn device_entries(&self) -> usize {
        self.device_entries
    }

    pub(super) fn device_pinned(&self) -> usize {
        self.device_pinned
    }

    pub(super) fn host_entries(&self) -> usize {
        self.host_entries
    }

    /// `id` and every entry below it, each after its descendants (so removing them in this
    /// order removes only childless entries). A scan of the slab: needed only to drop an
    /// entry that still has children, which eviction's rules make (next to) never happen.
    pub(super) fn subtree(&self, id: EntryId) -> Vec<EntryId> {
        if self.get(id).children == 0 {
            return vec![id];
        }
        // Depth below `id` of each live entry under it, memoized along parent walks.
        let mut depth: HashMap<EntryId, Option<usize>> = HashMap::from([(id, Some(0))]);
        let mut path = Vec::new();
        for start in 0..self.entries.len() as EntryId {
            let mut at = Some(start);
            let found = loop {
                let Some(cur) = at else { break None };
                if let Some(&d) = depth.get(&cur) {
                    break d;
                }
                match &self.entries[cur as usize] {
                    Some(e) => {
                        path.push(cur);
                        at = e.parent;
                    }
                    None => break None,
                }
            };
            for (i, &p) in path.iter().rev().enumerate() {
                depth.insert(p, found.map(|d| d + i + 1));
            }
            path.clear();
        }
        let mut below: Vec<(usize, EntryId)> = depth
            .into_iter()
            .filter_map(|(e, d)| d.map(|d| (d, e)))
            .collect();
        below.sort_unstable_by(|a, b| b.cmp(a));
        below.into_iter().map(|(_, e)| e).collect()
    }

    /// Applies `change` to an entry with its candidacy and counters kept in step.
    fn update(&mut self, id: EntryId, change: impl FnOnce(&mut Entry)) {
        self.unlist(id);
        change(self.entries[id as usize].as_mut().expect("live entry"));
        self.list(id);
    }

    fn list(&mut self, id: EntryId) {
        let e = self.entries[id as usize].as_ref().expect("live entry");
        let key = (e.last_used, id);
        match e.location {
            Location::Device(_) => {
                self.device_entries += 1;
                self.device_pinned += usize::from(e.pins > 0);
            }
            Location::Host(_) => self.host_entries += 1,
        }
        if e.device_candidate() {
            self.device_lru.insert(key);
        }
        if e.host_candidate() {
            self.host_lru.insert(key);
        }
    }

    fn unlist(&mut self, id: EntryId) {
        let e = self.entries[id as usize].as_ref().expect("live entry");
        let key = (e.last_used, id);
        match e.location {
            Location::Device(_) => {
                self.device_entries -= 1;
                self.device_pinned -= usize::from(e.pins > 0);
            }
            Location::Host(_) => self.host_entries -= 1,
        }
        if e.device_candidate() {
            let was = self.device_lru.remove(&key);
            debug_assert!(was, "device candidate {id} missing from its set");
        }
        if e.host_candidate() {
            let was = self.host_lru.remove(&key);
            debug_assert!(was, "host candidate {id} missing from its set");
        }
    }

    /// Live entries with their ids.
    #[cfg(test)]
    pub(super) fn iter(&self) -> impl Iterator<Item = (EntryId, &Entry)> {
        self.entries
            .iter()
            .enumerate()
            .filter_map(|(i, e)| e.as_ref().map(|e| (i as EntryId, e)))
    }

    /// Panics unless the index, the slab, the counts, the pins and the candidate sets agree
    /// with the entries (where they are is the manager's to check against its pool).
    #[cfg(test)]
    pub(super) fn check(&self) {
        let live: Vec<(EntryId, &Entry)> = self.iter().collect();
        assert_eq!(self.index.len(), live.len(), "index size != live entries");
        assert_eq!(
            live.len() + self.free_ids.len(),
            self.entries.len(),
            "slab: live + free ids != slots"
        );
        for &id in &self.free_ids {
            assert!(self.entries[id as usize].is_none(), "free id {id} is live");
        }
        let mut free_ids = self.free_ids.clone();
        free_ids.sort_unstable();
        free_ids.dedup();
        assert_eq!(free_ids.len(), self.free_ids.len(), "an id is free twice");

        let mut children: HashMap<EntryId, (u32, u32)> = HashMap::new();
        let (mut device, mut pinned, mut host) = (0, 0, 0);
        let mut device_lru = BTreeSet::new();
        let mut host_lru = BTreeSet::new();
        for &(id, e) in &live {
            assert_eq!(e.tokens.len(), self.block_size, "entry {id}: not one block");
            let key = (e.parent, e.tokens.clone());
            assert_eq!(
                self.index.get(&key),
                Some(&id),
                "entry {id}: key not indexed"
            );
            assert!(e.last_used <= self.clock, "entry {id}: used in the future");
            let on_device = matches!(e.location, Location::Device(_));
            if let Some(p) = e.parent {
                let parent = self.entries[p as usize]
                    .as_ref()
                    .unwrap_or_else(|| panic!("entry {id}: parent {p} is gone (broken chain)"));
                assert!(
                    parent.pins >= e.pins,
                    "entry {id}: {} pins but its parent {p} only {}",
                    e.pins,
                    parent.pins
                );
                assert!(
                    !on_device || matches!(parent.location, Location::Device(_)),
                    "entry {id} is on the device but its parent {p} is not"
                );
                let c = children.entry(p).or_default();
                c.0 += 1;
                c.1 += u32::from(on_device);
            }
            if on_device {
                device += 1;
                pinned += usize::from(e.pins > 0);
            } else {
                host += 1;
                assert_eq!(e.pins, 0, "host entry {id} pinned between calls");
            }
            if e.device_candidate() {
                device_lru.insert((e.last_used, id));
            }
            if e.host_candidate() {
                host_lru.insert((e.last_used, id));
            }
        }
        for &(id, e) in &live {
            let (c, d) = children.get(&id).copied().unwrap_or_default();
            assert_eq!(e.children, c, "entry {id}: children count");
            assert_eq!(e.device_children, d, "entry {id}: device children count");
        }
        assert_eq!(self.device_entries, device, "device entry count");
        assert_eq!(self.device_pinned, pinned, "pinned device entry count");
        assert_eq!(self.host_entries, host, "host entry count");
        assert_eq!(
            self.device_lru, device_lru,
            "device eviction candidates out of sync"
        );
        assert_eq!(
            self.host_lru, host_lru,
            "host eviction candidates out of sync"
        );
    }
}

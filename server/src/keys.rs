//! The only place Redis key and channel names are built. Names follow Redisson's
//! layout so Redisson clients on the same Redis see the same locks, and every key and
//! channel of one lock hashes to the same cluster slot.

/// Builds keys and channels for the server's key prefix.
#[derive(Debug, Clone, Default)]
pub struct Keys {
    prefix: String,
}

/// One lock's key, from which its other keys and channels are derived when used (all
/// in the lock's cluster slot). Only the lock key is kept: a held lease keeps its
/// request, and most derived names are needed once or twice in its life.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LockKeys {
    /// The lock hash (Redisson's raw name): the key prefix, then the lock's name.
    pub lock: String,
    /// Where the name starts in `lock`.
    name_at: usize,
}

impl Keys {
    /// Keys under `prefix` (empty for none).
    pub fn new(prefix: impl Into<String>) -> Self {
        Self { prefix: prefix.into() }
    }

    /// The server's key prefix.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// All keys of the lock `name`.
    pub fn lock(&self, name: &str) -> LockKeys {
        LockKeys {
            lock: [self.prefix.as_str(), name].concat(),
            name_at: self.prefix.len(),
        }
    }

    /// All keys of the lock `name`, or `None` when braces in the name keep its keys
    /// from sharing one cluster slot (an empty `{}` or an unclosed `{`).
    pub fn lock_checked(&self, name: &str) -> Option<LockKeys> {
        let keys = self.lock(name);
        // Without braces the lock key is its own hash tag in every derived key: nothing
        // to check (and no CRC to compute for each stream).
        if !keys.lock.is_empty() && !keys.lock.contains(['{', '}']) {
            return Some(keys);
        }
        let slot = keys.slot();
        (fred::util::redis_keyslot(keys.channel().as_bytes()) == slot).then_some(keys)
    }

    /// The lock name of a Redis key, if the key lies under the prefix.
    pub fn name_of<'a>(&self, key: &'a str) -> Option<&'a str> {
        key.strip_prefix(self.prefix.as_str())
    }

    /// The channel on which `ForceRelease` tells every server which lock was broken,
    /// so holders on other servers learn it at once.
    pub fn force_release_channel(&self) -> String {
        format!("{}latchkey:force_release", self.prefix)
    }
}

impl LockKeys {
    /// The cluster slot of the lock's key.
    pub fn slot(&self) -> u16 {
        fred::util::redis_keyslot(self.lock.as_bytes())
    }

    /// The lock's name as clients see it.
    pub fn name(&self) -> &str {
        &self.lock[self.name_at..]
    }

    /// The record prefix (of [`RECORD_PREFIXES`]) the lock key starts with, if any.
    pub fn record_prefix(&self) -> Option<&'static str> {
        RECORD_PREFIXES
            .into_iter()
            .find(|p| self.lock.strip_prefix(p).is_some_and(|rest| rest.starts_with(':')))
    }

    /// The unlock channel, `redisson_lock__channel:{lock}`.
    pub fn channel(&self) -> String {
        suffixed("redisson_lock__channel", &self.lock)
    }

    /// This server's presence channel for the lock, `latchkey_present:{lock}:<server>`:
    /// subscribed while a waiter here may leave a claim, so that a release can tell a
    /// claim of a live server from one a crashed server left (`lib.lua`'s `present`).
    pub fn presence(&self, server: &str) -> String {
        suffixed_then(PRESENCE, &self.lock, &[":", server])
    }

    /// The fencing counter of this name.
    pub fn fence(&self) -> String {
        suffixed("latchkey_fence", &self.lock)
    }

    /// The latest token passed in memory and recorded, with the fencing counter its
    /// recording left (`token:counter`): while the counter stays there, that token is
    /// the latest grant, the counter being reserved past it (scripts build it).
    pub fn fence_passed(&self) -> String {
        suffixed("latchkey_fence_passed", &self.lock)
    }

    /// The break floor of this name: the token ForceRelease took when it last broke the
    /// lock. Hold records at or below it belong to broken holds (scripts build it too).
    pub fn broken(&self) -> String {
        suffixed("latchkey_broken", &self.lock)
    }

    /// The fair lock's queue of owner ids (`redisson_lock_queue:{lock}`).
    pub fn queue(&self) -> String {
        suffixed("redisson_lock_queue", &self.lock)
    }

    /// The fair lock's waiter deadlines (`redisson_lock_timeout:{lock}`).
    pub fn timeouts(&self) -> String {
        suffixed("redisson_lock_timeout", &self.lock)
    }

    /// The read/write lock's channel (`redisson_rwlock:{lock}`).
    pub fn rw_channel(&self) -> String {
        suffixed("redisson_rwlock", &self.lock)
    }

    /// What the read/write lock's per-hold timeout keys start with (Redisson's key
    /// prefix: `{lock}`, or the lock itself when it carries a hash tag).
    pub fn rw_prefix(&self) -> String {
        if self.lock.contains('{') {
            self.lock.clone()
        } else {
            format!("{{{}}}", self.lock)
        }
    }

    /// The semaphore's limit, usage and per-hold permits.
    pub fn semaphore(&self) -> String {
        suffixed("latchkey_semaphore", &self.lock)
    }

    /// The semaphore's channel (`redisson_sc:{lock}`).
    pub fn semaphore_channel(&self) -> String {
        suffixed("redisson_sc", &self.lock)
    }

    /// Where every change of the lock is announced, for Watch (`latchkey_watch:{lock}`).
    pub fn watch(&self) -> String {
        suffixed("latchkey_watch", &self.lock)
    }

    /// The fair lock's wake-up channel of one waiting owner (Redisson's per-thread channel).
    pub fn owner_channel(&self, owner: &str) -> String {
        suffixed_then("redisson_lock__channel", &self.lock, &[":", owner])
    }

    /// The prefix of `field`'s per-hold timeout keys (`…:rwlock_timeout`, then `:<n>`): a
    /// reader's (`<owner>`) or a writer's (`<owner>:write`).
    pub fn hold_timeouts(&self, field: &str) -> String {
        let marker = READ_TIMEOUT_MARKER.trim_end_matches(':');
        format!("{}:{field}{marker}", self.rw_prefix())
    }

    /// The per-hold record of stream `hold_id`: it makes acquire and release safe to
    /// retry (a retried script finds the record and does not count the hold twice).
    pub fn hold(&self, hold_id: &str) -> String {
        suffixed_then("latchkey_hold", &self.lock, &[":", hold_id])
    }
}

/// What the keys a lock keeps beside its own start with, each followed by `:` (latchkey's
/// records, some built only by the scripts, and Redisson's fair queue): a lock key may
/// not be one of them, or taking that lock would overwrite another lock's record or make
/// its scripts fail on the key's type.
pub const RECORD_PREFIXES: [&str; 10] = [
    "latchkey_fence",
    "latchkey_fence_passed",
    "latchkey_broken",
    "latchkey_passing",
    "latchkey_turn",
    "latchkey_claims",
    "latchkey_hold",
    "latchkey_semaphore",
    "redisson_lock_queue",
    "redisson_lock_timeout",
];

/// What marks a read hold's timeout key (Redisson's `RReadWriteLock` layout:
/// `{name}:<owner>:rwlock_timeout:<n>`); lock names may not contain it.
pub const READ_TIMEOUT_MARKER: &str = ":rwlock_timeout:";

/// Redisson's `prefixName`: `prefix:{name}`, or `prefix:name` when the name already
/// carries a hash tag, so the result hashes to the same slot as `name`.
fn suffixed(prefix: &str, name: &str) -> String {
    suffixed_then(prefix, name, &[])
}

/// What a presence channel's name starts with (the key prefix goes inside it).
const PRESENCE: &str = "latchkey_present";

/// Whether `channel` is a presence channel ([`LockKeys::presence`]).
pub fn is_presence(channel: &str) -> bool {
    channel.strip_prefix(PRESENCE).is_some_and(|rest| rest.starts_with(':'))
}

/// `suffixed(prefix, name)` followed by `tail`, built in one allocation: a stream
/// builds several keys for each of its script calls.
fn suffixed_then(prefix: &str, name: &str, tail: &[&str]) -> String {
    let (open, close) = if name.contains('{') { (":", "") } else { (":{", "}") };
    let mut key = String::with_capacity(prefix.len() + name.len() + 3 + tail.iter().map(|t| t.len()).sum::<usize>());
    for part in [prefix, open, name, close].iter().chain(tail) {
        key.push_str(part);
    }
    key
}

#[cfg(test)]
mod tests {
    use super::*;
    use fred::util::redis_keyslot;

    #[test]
    fn presence_channels_are_told_apart() {
        for prefix in ["", "app:", "latchkey_present:"] {
            let k = Keys::new(prefix).lock("orders");
            assert!(is_presence(&k.presence("server-1")), "{prefix}");
            assert!(!is_presence(&k.channel()), "{prefix}");
        }
        assert!(!is_presence("latchkey_presentation:{x}"));
    }

    #[test]
    fn redisson_channel_names() {
        let k = Keys::default().lock("orders");
        assert_eq!(k.lock, "orders");
        assert_eq!(k.channel(), "redisson_lock__channel:{orders}");
        let k = Keys::default().lock("{user}:1");
        assert_eq!(k.channel(), "redisson_lock__channel:{user}:1");
    }

    #[test]
    fn every_key_shares_the_lock_slot() {
        for name in ["orders", "{user}:1", "a{b}c", "ünïcode", "{a}{b}"] {
            for prefix in ["", "app:", "{p}"] {
                let k = Keys::new(prefix).lock_checked(name).unwrap();
                let slot = redis_keyslot(k.lock.as_bytes());
                let derived = [
                    k.channel(),
                    k.fence(),
                    k.broken(),
                    k.fence_passed(),
                    k.hold("h1"),
                    k.queue(),
                    k.timeouts(),
                    k.rw_channel(),
                    k.semaphore(),
                    k.semaphore_channel(),
                    k.watch(),
                    k.owner_channel("o:1"),
                    k.presence("srv-1"),
                    format!("{}:1", k.hold_timeouts("o:1")),
                ];
                for other in &derived {
                    assert_eq!(redis_keyslot(other.as_bytes()), slot, "{other} vs {}", k.lock);
                }
            }
        }
    }

    #[test]
    fn redisson_names_of_the_other_kinds() {
        let k = Keys::default().lock("orders");
        assert_eq!(k.queue(), "redisson_lock_queue:{orders}");
        assert_eq!(k.timeouts(), "redisson_lock_timeout:{orders}");
        assert_eq!(k.owner_channel("u:1"), "redisson_lock__channel:{orders}:u:1");
        assert_eq!(k.rw_channel(), "redisson_rwlock:{orders}");
        assert_eq!(k.hold_timeouts("u:1"), "{orders}:u:1:rwlock_timeout");
        assert_eq!(
            Keys::default().lock("a{b}").hold_timeouts("u:1"),
            "a{b}:u:1:rwlock_timeout"
        );
    }

    #[test]
    fn every_record_key_is_known_as_one() {
        for prefix in ["", "app:"] {
            let k = Keys::new(prefix).lock("orders");
            let records = [
                k.fence(),
                k.fence_passed(),
                k.broken(),
                k.hold("h1"),
                k.queue(),
                k.timeouts(),
                k.semaphore(),
            ];
            for record in records {
                assert!(Keys::default().lock(&record).record_prefix().is_some(), "{record}");
            }
        }
        for lock in [
            "orders",
            "latchkey_app:orders",
            "latchkey_holder:x",
            "redisson_lock__channel:{x}",
        ] {
            assert_eq!(Keys::default().lock(lock).record_prefix(), None, "{lock}");
        }
    }

    #[test]
    fn braces_that_split_slots_are_refused() {
        for name in ["{}", "x{", "x}{y", "{}{a}", "x}y"] {
            assert!(Keys::default().lock_checked(name).is_none(), "{name}");
        }
    }

    #[test]
    fn prefix_round_trips() {
        let keys = Keys::new("app:");
        let k = keys.lock("orders");
        assert_eq!(k.lock, "app:orders");
        assert_eq!(k.name(), "orders");
        assert_eq!(keys.name_of(&k.lock), Some("orders"));
        assert_eq!(keys.name_of("other"), None);
    }
}

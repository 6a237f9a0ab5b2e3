//! A seeded xorshift64 generator: the emulator and the workloads built on it must replay
//! byte for byte from a seed, across runs and machines, so they share this one.

/// Marsaglia's xorshift64 (13, 7, 17). Not for anything secret; a zero state stays zero.
#[derive(Debug, Clone)]
pub struct XorShift64(u64);

impl XorShift64 {
    /// A generator whose first output is derived from `state` (pass a non-zero value).
    pub fn from_state(state: u64) -> Self {
        Self(state)
    }

    /// The next 64 pseudo-random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// A uniform float in `[0, 1)` from the top 53 bits.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// The current state, which identifies the stream position (used for stable ids).
    pub fn state(&self) -> u64 {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::XorShift64;

    #[test]
    fn replays_from_a_seed_and_stays_in_range() {
        let mut a = XorShift64::from_state(23);
        let mut b = XorShift64::from_state(23);
        let first: Vec<u64> = (0..4).map(|_| a.next_u64()).collect();
        assert_eq!(first, (0..4).map(|_| b.next_u64()).collect::<Vec<_>>());
        assert_ne!(first[0], first[1]);
        assert!((0..1000).all(|_| (0.0..1.0).contains(&a.unit())));
    }
}

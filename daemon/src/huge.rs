//! An allocator for the index's large tables that asks the kernel for transparent huge
//! pages.
//!
//! A walk probes one random place of a table per block key, and the tables of a full index
//! span tens of megabytes: with 4 KiB pages nearly every probe also misses the TLB, and on a
//! virtual machine each miss walks two levels of page tables. Many distributions (Debian
//! and Ubuntu among them) ship transparent huge pages as `madvise`, given only to regions
//! that ask, so the tables ask. Measured in `docs/benchmarks/scale.md` (Reading it: huge
//! pages).
//!
//! Only whole 2 MiB-aligned spans of a block are advised, so the advice never reaches past
//! it. A block glibc serves from its heap rather than its own mapping (glibc raises its
//! mapping threshold as large blocks are freed) leaves the advice on those spans once it is
//! freed; later small allocations there may then be backed by huge pages, which costs
//! memory, never correctness.

#![allow(unsafe_code)]

use std::alloc::Layout;
use std::ptr::NonNull;

use allocator_api2::alloc::{AllocError, Allocator, Global};

/// Allocations at least this large are advised: a region smaller than two huge pages holds
/// at most one of them.
const ADVISED_FROM: usize = 2 * HUGE_PAGE;

/// The huge page size with 4 KiB base pages (x86-64, most aarch64 kernels); also a
/// multiple of every base page size up to it, so spans aligned to it are page-aligned
/// wherever the kernel's pages are 4, 16 or 64 KiB.
const HUGE_PAGE: usize = 2 << 20;

/// A hash map as large as the blocks it indexes, on huge pages.
pub type HugeMap<K, V> = hashbrown::HashMap<K, V, foldhash::fast::RandomState, HugePages>;

/// The global allocator, with huge pages asked for on allocations of [`ADVISED_FROM`] or
/// more. The advice is only a hint: where the kernel has transparent huge pages off, or the
/// platform is not Linux, this is the global allocator.
#[derive(Clone, Copy, Debug, Default)]
pub struct HugePages;

// SAFETY: every block comes from and goes back to `Global` with the layout it was asked
// for; the advice changes how the kernel backs the pages, never their contents.
unsafe impl Allocator for HugePages {
    fn allocate(&self, layout: Layout) -> Result<NonNull<[u8]>, AllocError> {
        let block = Global.allocate(layout)?;
        if layout.size() >= ADVISED_FROM {
            advise(block.cast::<u8>(), layout.size());
        }
        Ok(block)
    }

    unsafe fn deallocate(&self, ptr: NonNull<u8>, layout: Layout) {
        // SAFETY: the caller passes a block this allocator (so `Global`) gave, with its
        // layout.
        unsafe { Global.deallocate(ptr, layout) }
    }
}

/// The kernel's transparent huge page mode (`always`, `madvise` or `never`), logged at
/// start: with `never`, walks of a large index wait on address translation.
pub fn kernel_mode() -> Option<String> {
    let modes = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").ok()?;
    let chosen = modes.split_whitespace().find(|m| m.starts_with('['))?;
    Some(chosen.trim_matches(['[', ']']).to_owned())
}

/// Asks for huge pages on the whole [`HUGE_PAGE`] spans inside `len` bytes from `start`;
/// errors (no transparent huge pages in this kernel) leave the pages as they were.
#[cfg(target_os = "linux")]
fn advise(start: NonNull<u8>, len: usize) {
    let addr = start.as_ptr() as usize;
    let first = addr.next_multiple_of(HUGE_PAGE);
    let end = (addr + len) / HUGE_PAGE * HUGE_PAGE;
    if end > first {
        // SAFETY: [first, end) lies inside the block just allocated and is aligned to a
        // multiple of the base page, so the kernel rounds nothing outward; MADV_HUGEPAGE
        // neither reads nor changes the memory.
        unsafe {
            libc::madvise(first as *mut libc::c_void, end - first, libc::MADV_HUGEPAGE);
        }
    }
}

#[cfg(not(target_os = "linux"))]
fn advise(_start: NonNull<u8>, _len: usize) {}

#[cfg(test)]
mod tests {
    use super::*;

    /// The `VmFlags` of the mapping that holds `addr`, from `/proc/self/smaps`.
    fn flags_at(addr: usize) -> Vec<String> {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap_or_default();
        let mut inside = false;
        for line in smaps.lines() {
            let range = line
                .split_whitespace()
                .next()
                .and_then(|r| r.split_once('-'));
            if let Some((Ok(start), Ok(end))) =
                range.map(|(a, b)| (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16)))
            {
                inside = (start..end).contains(&addr);
            } else if let Some(flags) = line.strip_prefix("VmFlags:").filter(|_| inside) {
                return flags.split_whitespace().map(str::to_owned).collect();
            }
        }
        Vec::new()
    }

    /// The advice is on the block (`hg`: the kernel will back it with huge pages where its
    /// mode and free memory allow; whether it did is up to them, so it is not asserted).
    #[test]
    fn a_large_block_is_advised_and_a_small_one_is_not() {
        let advised = |size: usize| {
            let layout = Layout::from_size_align(size, 64).unwrap();
            let block = HugePages.allocate(layout).unwrap().cast::<u8>();
            for offset in (0..size).step_by(4096) {
                // SAFETY: `offset` is inside the block, which is this test's alone.
                unsafe { block.as_ptr().add(offset).write(1) };
            }
            // The advice splits the mapping where its spans begin: ask about the middle.
            let flags = flags_at(block.as_ptr() as usize + size / 2);
            // SAFETY: allocated above with this layout.
            unsafe { HugePages.deallocate(block, layout) };
            flags.iter().any(|f| f == "hg")
        };
        // A kernel built without transparent huge pages has no mode and refuses the advice.
        // The small block goes first: once glibc frees a large block it raises its mapping
        // threshold, and a later 1 MiB block may come from a heap span advised before.
        assert!(!advised(1 << 20), "a 1 MiB block is left as it was");
        let kernel_has_them = kernel_mode().is_some();
        assert_eq!(advised(32 << 20), kernel_has_them, "a 32 MiB block");
    }
}

//! An allocator for the index's large tables that asks the kernel for transparent huge
//! pages.
//!
//! A walk probes one random place of a table per block key, and the tables of a full index
//! span tens of megabytes: with 4 KiB pages nearly every probe also misses the TLB, and on a
//! virtual machine each miss walks two levels of page tables. Most distributions ship
//! transparent huge pages as `madvise` (only regions that ask get them), so the tables ask.
//! Measured in `docs/benchmarks/scale.md` (Reading it: huge pages).

#![allow(unsafe_code)]

use std::alloc::Layout;
use std::ptr::NonNull;

use allocator_api2::alloc::{AllocError, Allocator, Global};

/// Allocations at least this large are advised: a huge page is 2 MiB on x86-64 and
/// aarch64, and a region smaller than two holds at most one of them.
const ADVISED_FROM: usize = 4 << 20;

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

/// Asks for huge pages on the whole pages inside `len` bytes from `start`; errors (no
/// transparent huge pages in this kernel) leave the pages as they were.
#[cfg(target_os = "linux")]
fn advise(start: NonNull<u8>, len: usize) {
    const PAGE: usize = 4096;
    let addr = start.as_ptr() as usize;
    let first = addr.next_multiple_of(PAGE);
    let end = (addr + len) / PAGE * PAGE;
    if end > first {
        // SAFETY: [first, end) lies inside the block just allocated, is page-aligned, and
        // MADV_HUGEPAGE neither reads nor changes the memory.
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

    /// Huge pages backing the mapping that holds `addr`, in kB, from `/proc/self/smaps`.
    fn huge_kb_at(addr: usize) -> u64 {
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
            } else if let Some(kb) = line.strip_prefix("AnonHugePages:").filter(|_| inside) {
                return kb.trim().trim_end_matches("kB").trim().parse().unwrap_or(0);
            }
        }
        0
    }

    #[test]
    fn a_large_block_is_backed_by_huge_pages_where_the_kernel_gives_them() {
        let thp = kernel_mode();
        let layout = Layout::from_size_align(32 << 20, 64).unwrap();
        let block = HugePages.allocate(layout).unwrap().cast::<u8>();
        // SAFETY: the block is 32 MiB long and this test's alone; each page is written once.
        let bytes = unsafe { std::slice::from_raw_parts_mut(block.as_ptr(), layout.size()) };
        bytes.iter_mut().step_by(4096).for_each(|b| *b = 1);
        // The advice splits the mapping where whole pages begin: ask about the middle.
        let huge = huge_kb_at(block.as_ptr() as usize + layout.size() / 2);
        // SAFETY: allocated above with this layout.
        unsafe { HugePages.deallocate(block, layout) };
        match thp.as_deref() {
            None | Some("never") => {
                assert_eq!(huge, 0, "no huge pages where the kernel has them off")
            }
            Some(mode) => assert!(
                huge >= 16 << 10,
                "a 32 MiB block got {huge} kB of huge pages (THP: {mode})"
            ),
        }
    }
}

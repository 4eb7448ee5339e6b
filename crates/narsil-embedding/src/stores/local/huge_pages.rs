//! Memory-store table rows on 2 MiB pages, on purpose.
//!
//! The stage's lookups are random reads over tables far larger than the
//! TLB covers with 4 KiB pages: each id costs a page walk besides its row.
//! A table of at least one huge page is therefore read into anonymous
//! memory of its own, aligned to 2 MiB and advised `MADV_HUGEPAGE` before
//! its bytes are written, so that the kernel backs it with transparent huge
//! pages where it is allowed to (`/sys/kernel/mm/transparent_hugepage/
//! enabled` `always` or `madvise`) and has free 2 MiB pages. The mapping is
//! rounded up to a whole huge page: at most 2 MiB more per table. Freed
//! with the table (`munmap`), so a reload returns a replaced table's memory
//! at once.
//!
//! Smaller tables stay on the heap (one huge page each would cost more
//! than they gain), and so does every table when `NARSIL_TABLE_HUGE_PAGES`
//! is `off` (to measure what huge pages bring). [`HugePageRows::huge_bytes`]
//! reads back, from `/proc/self/smaps`, how much of a table the kernel put
//! on huge pages, which the store logs per model; [`why_not_huge`] says why
//! a table got none.

use std::io;
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

/// The huge page size (x86-64 and aarch64 with 4 KiB base pages).
pub const HUGE_PAGE: usize = 2 << 20;

/// Whether tables of at least [`HUGE_PAGE`] go on huge pages (the
/// default), or stay on the heap (`NARSIL_TABLE_HUGE_PAGES=off`).
pub fn huge_pages_wanted() -> bool {
    static WANTED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *WANTED.get_or_init(|| std::env::var("NARSIL_TABLE_HUGE_PAGES").map_or(true, |v| v != "off"))
}

/// Whether `len` bytes held in memory go on huge pages: they are wanted
/// and `len` is at least one.
pub fn worth_huge_pages(len: usize) -> bool {
    huge_pages_wanted() && len >= HUGE_PAGE
}

/// `/proc/self/smaps`, for [`HugePageRows::huge_bytes`] (read once for
/// many tables: the kernel walks every mapping to write it).
pub fn smaps() -> io::Result<String> {
    std::fs::read_to_string("/proc/self/smaps")
}

/// `len` bytes of anonymous memory, aligned to [`HUGE_PAGE`], advised
/// `MADV_HUGEPAGE`, zeroed, owned like a `Vec<u8>`.
pub struct HugePageRows {
    ptr: NonNull<u8>,
    len: usize,
    /// The mapping's length: `len` rounded up to whole huge pages.
    mapped: usize,
}

// SAFETY: the mapping is owned by this value alone (no alias escapes but
// through `&self`/`&mut self` borrows), like a `Vec<u8>`'s buffer.
unsafe impl Send for HugePageRows {}
// SAFETY: shared access only reads through `&[u8]`.
unsafe impl Sync for HugePageRows {}

impl HugePageRows {
    /// Maps `len` (> 0) zeroed bytes (module docs).
    pub fn zeroed(len: usize) -> io::Result<Self> {
        if len == 0 {
            return Err(io::Error::other("an empty table has no pages"));
        }
        let mapped = len.div_ceil(HUGE_PAGE) * HUGE_PAGE;
        // One huge page more, to cut an aligned start out of.
        let over = mapped + HUGE_PAGE;
        // SAFETY: a fresh private anonymous mapping; no existing memory is
        // touched.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                over,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let start = (base as usize).next_multiple_of(HUGE_PAGE);
        let head = start - base as usize;
        let tail = over - head - mapped;
        // SAFETY: both ranges lie inside the mapping just made and outside
        // [start, start + mapped), which is kept; unmapping page-aligned
        // parts of an anonymous mapping cannot fail for any other reason
        // worth handling (the parts stay mapped, unused, until exit).
        unsafe {
            if head > 0 {
                libc::munmap(base, head);
            }
            if tail > 0 {
                libc::munmap((start + mapped) as *mut libc::c_void, tail);
            }
            // Only a hint: refused (THP `never`, an old kernel), the rows
            // live on 4 KiB pages and are served the same.
            libc::madvise(start as *mut libc::c_void, mapped, libc::MADV_HUGEPAGE);
        }
        let ptr = NonNull::new(start as *mut u8).ok_or_else(|| io::Error::other("mmap returned null"))?;
        Ok(Self { ptr, len, mapped })
    }

    /// A copy of `bytes` on huge pages.
    pub fn copy_of(bytes: &[u8]) -> io::Result<Self> {
        let mut rows = Self::zeroed(bytes.len())?;
        rows.copy_from_slice(bytes);
        Ok(rows)
    }

    /// A copy of `bytes` on huge pages where they are worth it
    /// ([`worth_huge_pages`]) and can be had; `None` where the bytes stay
    /// where they are.
    pub fn copy_if_worth(bytes: &[u8]) -> Option<Self> {
        worth_huge_pages(bytes.len()).then(|| Self::copy_of(bytes).ok()).flatten()
    }

    /// How many of its bytes the kernel backs with huge pages: from
    /// `smaps` ([`smaps`]), its mapping's `AnonHugePages` over its `Size`
    /// (the kernel may have merged the mapping with an adjacent one advised
    /// alike, another table's: then that merged mapping's share).
    pub fn huge_bytes(&self, smaps: &str) -> io::Result<u64> {
        huge_share(smaps, self.ptr.as_ptr() as u64, self.len)
    }
}

/// Of `len` bytes mapped at `at`, how many the kernel backs with huge
/// pages according to `smaps`: the `AnonHugePages` of the mapping holding
/// `at` over its `Size`, times `len` (at most `len`).
fn huge_share(smaps: &str, at: u64, len: usize) -> io::Result<u64> {
    let mut lines = smaps.lines();
    lines
        .by_ref()
        .find(|line| mapping_range(line).is_some_and(|(start, end)| start <= at && at < end))
        .ok_or_else(|| io::Error::other("the table's mapping is not in /proc/self/smaps"))?;
    let (mut size, mut huge) = (None, None);
    for line in lines.take_while(|line| mapping_range(line).is_none()) {
        let kb = |field: &str| line.strip_prefix(field).and_then(|v| v.trim().strip_suffix("kB"));
        if let Some(kb) = kb("Size:") {
            size = kb.trim().parse::<u64>().ok();
        } else if let Some(kb) = kb("AnonHugePages:") {
            huge = kb.trim().parse::<u64>().ok();
        }
    }
    match (size, huge) {
        (Some(size), Some(huge)) if size > 0 => {
            Ok(((huge as f64 / size as f64) * len as f64).round().min(len as f64) as u64)
        }
        _ => Err(io::Error::other(
            "no Size and AnonHugePages lines for the table's mapping in /proc/self/smaps",
        )),
    }
}

/// The address range of a `/proc/self/smaps` mapping header line
/// (`start-end perms offset dev inode [path]`), or `None` for a field line.
fn mapping_range(line: &str) -> Option<(u64, u64)> {
    let (start, end) = line.split_whitespace().next()?.split_once('-')?;
    Some((u64::from_str_radix(start, 16).ok()?, u64::from_str_radix(end, 16).ok()?))
}

impl Deref for HugePageRows {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr` points at `mapped >= len` readable bytes, owned by
        // `self`, zeroed at creation, so initialized.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl DerefMut for HugePageRows {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, borrowed exclusively through `&mut self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for HugePageRows {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `zeroed`, unmapped once; no borrow of
        // it outlives `self`.
        unsafe {
            libc::munmap(self.ptr.as_ptr().cast(), self.mapped);
        }
    }
}

/// Why a table advised `MADV_HUGEPAGE` got no huge pages, as far as this
/// process can tell.
pub fn why_not_huge() -> String {
    let enabled = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").unwrap_or_default();
    if enabled.contains("[never]") {
        "transparent huge pages are off on this machine (/sys/kernel/mm/transparent_hugepage/enabled: never)"
            .into()
    } else if enabled.is_empty() {
        "this kernel has no transparent huge pages (/sys/kernel/mm/transparent_hugepage/enabled missing)"
            .into()
    } else {
        "the kernel had too few free 2 MiB pages (memory fragmented; see /proc/buddyinfo, or \
         /sys/kernel/mm/transparent_hugepage/defrag)"
            .into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_are_aligned_zeroed_writable_and_rounded_to_whole_huge_pages() {
        let mut rows = HugePageRows::zeroed(HUGE_PAGE + 10).unwrap();
        assert_eq!(rows.len(), HUGE_PAGE + 10);
        assert_eq!(rows.as_ptr() as usize % HUGE_PAGE, 0);
        assert_eq!(rows.mapped, 2 * HUGE_PAGE);
        assert!(rows.iter().all(|&b| b == 0));
        rows[HUGE_PAGE + 9] = 7;
        let copy = HugePageRows::copy_of(&rows).unwrap();
        assert_eq!(&copy[..], &rows[..]);
        assert!(HugePageRows::zeroed(0).is_err());
    }

    #[test]
    fn the_bytes_on_huge_pages_are_the_share_smaps_gives_the_mapping_holding_them() {
        let text = "\
7f00a0000000-7f00a0400000 rw-p 00000000 00:00 0
Size:               4096 kB
AnonHugePages:      2048 kB
VmFlags: rd wr mr mw me ac sd hg
7f00b0000000-7f00b0200000 rw-p 00000000 00:00 0
Size:               2048 kB
AnonHugePages:         0 kB
";
        // Half of the first mapping is on huge pages: half of its bytes.
        assert_eq!(huge_share(text, 0x7f00a0000000, 4 << 20).unwrap(), 2 << 20);
        assert_eq!(huge_share(text, 0x7f00a0100000, 1000).unwrap(), 500);
        // The second mapping's fields, not the first's.
        assert_eq!(huge_share(text, 0x7f00b0000000, 2 << 20).unwrap(), 0);
        // An address no mapping holds, and a mapping without the fields.
        assert!(huge_share(text, 0x7f00c0000000, 10).unwrap_err().to_string().contains("not in"));
        let bare = "7f00a0000000-7f00a0400000 rw-p 00000000 00:00 0 \nVmFlags: rd\n";
        assert!(huge_share(bare, 0x7f00a0000000, 10).unwrap_err().to_string().contains("AnonHugePages"));
        assert_eq!(mapping_range("AnonHugePages:      4096 kB"), None);
        // This process's own smaps names a mapping made here.
        let rows = HugePageRows::copy_of(&vec![1u8; 4 * HUGE_PAGE]).unwrap();
        let huge = rows.huge_bytes(&smaps().unwrap()).unwrap();
        eprintln!("{huge} of {} bytes on huge pages", rows.len());
    }
}

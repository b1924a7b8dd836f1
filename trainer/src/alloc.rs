//! [`ReportingAllocator`]: the system allocator, with an allocation failure reported as a
//! clear one-line error and exit code 1 instead of Rust's abort (SIGABRT, a core dump and, under
//! the launcher, a signal where the user needed a sentence).
//!
//! The memory pre-flight refuses models whose parameters cannot fit before any rank starts; this
//! catches what it cannot see (activations of a huge batch, a data set larger than memory).
//! Install it in a binary with
//! `#[global_allocator] static ALLOC: trainer::alloc::ReportingAllocator = trainer::alloc::ReportingAllocator;`
//! (the `trainer` binary does). Note: with it, a failed `try_reserve` also exits.

use std::alloc::{GlobalAlloc, Layout, System};

/// The system allocator, exiting with a clear message when an allocation fails.
pub struct ReportingAllocator;

// SAFETY: every method forwards to `System` with the same arguments and returns its result
// unchanged; a null result never returns (the process exits).
unsafe impl GlobalAlloc for ReportingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded as is (the caller upholds `GlobalAlloc::alloc`'s contract).
        checked(unsafe { System.alloc(layout) }, layout.size())
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as above.
        checked(unsafe { System.alloc_zeroed(layout) }, layout.size())
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: as above.
        checked(unsafe { System.realloc(ptr, layout, new_size) }, new_size)
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }
}

fn checked(ptr: *mut u8, size: usize) -> *mut u8 {
    if ptr.is_null() {
        out_of_memory(size);
    }
    ptr
}

/// Writes the message without allocating (there is no memory to format with) and exits.
fn out_of_memory(size: usize) -> ! {
    let mut digits = [0u8; 20];
    let mut n = size;
    let mut start = digits.len();
    loop {
        start -= 1;
        digits[start] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    let parts: [&[u8]; 3] = [
        b"error: out of memory: allocating ",
        &digits[start..],
        b" bytes failed; the model, the batch (training.batch_size) or the data set does not fit \
in this machine's memory (or its limit): make one smaller, or run fewer ranks per machine\n",
    ];
    for part in parts {
        // SAFETY: write(2) of a valid buffer to stderr; a short or failed write loses only text.
        unsafe {
            libc::write(2, part.as_ptr().cast(), part.len());
        }
    }
    // SAFETY: _exit(2) ends the process at once, without running code that could allocate.
    unsafe { libc::_exit(1) }
}

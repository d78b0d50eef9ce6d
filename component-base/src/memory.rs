//! The process's memory: handing what a burst of work freed back to the operating system.

/// Hand the memory freed after a burst of many small allocations (a full sync of the
/// agent's rules; the address history's first write of every address) back from the C
/// allocator now: glibc keeps freed blocks in its per-thread arenas, counted in the
/// process's resident memory, and consolidates them only at a later allocation. A no-op
/// where the allocator is not glibc's.
#[allow(unsafe_code)]
pub fn release_freed() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only works on the allocator's own state; it takes no pointers.
    unsafe {
        libc::malloc_trim(0);
    }
}

// Package powercut is a FUSE loopback filesystem for tests that simulates
// a power loss: Mount mirrors a backing directory at a mountpoint, keeps
// track of what has reached the "disk", and Cut throws away the rest, as a
// power cut would, so that a test can measure what a server (valkey-server
// with its append-only file, say) keeps of what it acknowledged.
//
// The model, which Cut applies once every process using the mount has
// been killed (SIGKILL) and reaped:
//
//   - File data is durable only up to the size the file had at its last
//     completed fsync or fdatasync, lowered by any truncation since. Cut
//     truncates every file to that size; a file never fsynced is
//     truncated to 0 (or removed, below). Bytes overwritten in place after
//     an fsync keep their new content: the model follows appends, which is
//     how an append-only file is written.
//   - Names (create, mkdir, unlink, rmdir, rename, link, symlink, mknod)
//     go through one ordered journal, as on ext4 (data=ordered) or XFS:
//     each change of a name is durable once any fsync or fsyncdir, of any
//     file or directory of the mount, completes after it, since a real
//     fsync commits the journal and every change logged before it. Cut
//     undoes, newest first, the changes that no fsync followed: a file
//     created since is removed, a file unlinked since is back, and a
//     rename is reverted, the file back under its old name and the file it
//     replaced, if any, back under the new one. So a temp file renamed
//     over a manifest without a directory fsync survives only if something
//     fsyncs after the rename; Valkey fsyncs the directory right after
//     renaming its manifest. A stricter POSIX model, a name durable only
//     once its own directory is fsynced, would lose Valkey's appendonlydir,
//     whose parent Valkey never fsyncs, which no journaling filesystem does.
//
// The backing files are never fsynced themselves: durability is the
// model's, so an fsync costs a FUSE round trip, not a disk's. Cut
// unmounts, rewrites the backing directory and mounts again, as a reboot
// would, so that no kernel cache outlives it. Metadata other than names
// and sizes (modes, times, extended attributes) is not modelled.
package powercut

import (
	"errors"
	"fmt"
	iofs "io/fs"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"

	"github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
)

// FS is a mounted power-cut filesystem. Its methods are safe for
// concurrent use with the filesystem's own operations.
type FS struct {
	// Dir is the mountpoint: the directory to give the server under test.
	Dir string
	// data is the backing directory the mount mirrors, and shadow holds
	// hard links to files that uncommitted changes removed or replaced,
	// so that Cut can bring them back. Both are in one filesystem, so a
	// node's StableAttr().Ino is its backing file's inode number.
	data, shadow string

	mu sync.Mutex
	// server is the FUSE server while mounted, nil after Close.
	server *fuse.Server
	// synced maps a backing file's inode number to the size its last
	// completed fsync covered (lowered by truncations since); a file
	// missing from it was never fsynced and keeps nothing.
	synced map[uint64]int64
	// undo reverts, newest last, the changes of names since the last
	// completed fsync of anything (see the package doc); each is run with
	// the mount gone, on backing paths, after every newer one.
	undo []func() error
	// shadows counts the links made in shadow, to name the next one.
	shadows int
}

// Mount makes dir/data (the backing directory, kept if it exists),
// dir/shadow and dir/mnt, and mounts at dir/mnt a loopback of dir/data.
// Every file already in dir/data counts as durable at its present size.
// Close unmounts it.
func Mount(dir string) (*FS, error) {
	f := &FS{Dir: filepath.Join(dir, "mnt"), data: filepath.Join(dir, "data"), shadow: filepath.Join(dir, "shadow")}
	for _, d := range []string{f.Dir, f.data, f.shadow} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return nil, fmt.Errorf("powercut: %w", err)
		}
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.settleLocked(); err != nil {
		return nil, err
	}
	return f, f.mountLocked()
}

// mountLocked mounts the loopback of f.data at f.Dir.
func (f *FS) mountLocked() error {
	root, err := fs.NewLoopbackRoot(f.data)
	if err != nil {
		return fmt.Errorf("powercut: %w", err)
	}
	rn := &node{LoopbackNode: root.(*fs.LoopbackNode), fsys: f}
	rn.RootData.RootNode = rn
	// No entry or attribute timeouts: the kernel asks for every lookup
	// and size, so that nothing it caches hides a change of the model.
	srv, err := fs.Mount(f.Dir, rn, &fs.Options{MountOptions: fuse.MountOptions{FsName: f.data, Name: "powercut"}})
	if err != nil {
		return fmt.Errorf("powercut: mounting %s: %w", f.Dir, err)
	}
	f.server = srv
	return nil
}

// Close unmounts the filesystem, leaving the backing directory as it is;
// calling it again does nothing.
func (f *FS) Close() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.unmountLocked()
}

func (f *FS) unmountLocked() error {
	if f.server == nil {
		return nil
	}
	if err := f.server.Unmount(); err != nil {
		return fmt.Errorf("powercut: unmounting %s (is a process still using it?): %w", f.Dir, err)
	}
	f.server = nil
	return nil
}

// Cut simulates a power loss and the reboot after it: it unmounts the
// filesystem, undoes the changes of names no fsync followed, truncates
// every file to the size its last fsync covered, and mounts it again. Kill
// (SIGKILL) and reap every process using the mount first: Cut fails while
// one holds a file open, and whatever a live process did after the cut
// would count as after the reboot.
func (f *FS) Cut() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.unmountLocked(); err != nil {
		return err
	}
	for i := len(f.undo) - 1; i >= 0; i-- {
		if err := f.undo[i](); err != nil {
			return fmt.Errorf("powercut: undoing an uncommitted change: %w", err)
		}
	}
	f.undo = nil
	if err := f.settleLocked(); err != nil {
		return err
	}
	return f.mountLocked()
}

// settleLocked truncates every backing file to the size its last fsync
// covered, and then makes what is left the durable state: every file
// durable at its size, no change to undo, no shadow link.
func (f *FS) settleLocked() error {
	synced := map[uint64]int64{}
	err := filepath.WalkDir(f.data, func(path string, d iofs.DirEntry, err error) error {
		if err != nil || !d.Type().IsRegular() {
			return err
		}
		fi, err := d.Info()
		if err != nil {
			return err
		}
		ino, size := fi.Sys().(*syscall.Stat_t).Ino, fi.Size()
		if f.synced != nil && f.synced[ino] < size {
			size = f.synced[ino]
			if err := os.Truncate(path, size); err != nil {
				return err
			}
		}
		synced[ino] = size
		return nil
	})
	if err != nil {
		return fmt.Errorf("powercut: %w", err)
	}
	f.synced = synced
	return f.clearShadowLocked()
}

// clearShadowLocked removes the shadow links, once nothing can need them.
func (f *FS) clearShadowLocked() error {
	if f.shadows == 0 {
		return nil
	}
	f.shadows = 0
	if err := os.RemoveAll(f.shadow); err != nil {
		return fmt.Errorf("powercut: %w", err)
	}
	return os.Mkdir(f.shadow, 0o755)
}

// fsynced records a completed fsync of the file with inode ino, then of
// size bytes, and commits every change of a name made before it.
func (f *FS) fsynced(ino uint64, size int64) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.synced[ino] = size
	return f.commitLocked()
}

// commitLocked makes every change of a name so far durable: Cut no longer
// undoes them.
func (f *FS) commitLocked() error {
	f.undo = nil
	return f.clearShadowLocked()
}

// truncated records that the file with inode ino was cut to size: what its
// last fsync covered beyond that is gone.
func (f *FS) truncated(ino uint64, size int64) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if s, ok := f.synced[ino]; ok && size < s {
		f.synced[ino] = size
	}
}

// change runs do, which changes names, with f locked, so that nothing
// commits between the two. Before, it keeps what is at the backing path
// keep (a file a change removes or replaces; none when keep is ""). When do
// succeeds, Cut will run undo and then put back what it kept.
func (f *FS) change(keep string, do func() syscall.Errno, undo func() error) syscall.Errno {
	f.mu.Lock()
	defer f.mu.Unlock()
	restore, err := f.keepLocked(keep)
	if err != nil {
		return fs.ToErrno(err)
	}
	if errno := do(); errno != 0 {
		return errno
	}
	f.undo = append(f.undo, func() error { return errors.Join(undo(), restore()) })
	return 0
}

// keepLocked returns what puts back the entry now at the backing path p
// after a change removed it: a file (or symlink) is hard-linked into the
// shadow directory and renamed back, an (empty) directory made again;
// nothing at p, or p "", needs nothing.
func (f *FS) keepLocked(p string) (restore func() error, err error) {
	none := func() error { return nil }
	if p == "" {
		return none, nil
	}
	fi, err := os.Lstat(p)
	switch {
	case errors.Is(err, iofs.ErrNotExist):
		return none, nil
	case err != nil:
		return nil, err
	case fi.IsDir():
		return func() error { return os.Mkdir(p, fi.Mode().Perm()) }, nil
	}
	f.shadows++
	link := filepath.Join(f.shadow, strconv.Itoa(f.shadows))
	if err := os.Link(p, link); err != nil {
		return nil, err
	}
	return func() error { return os.Rename(link, p) }, nil
}

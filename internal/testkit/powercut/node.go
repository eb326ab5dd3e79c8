package powercut

import (
	"context"
	"os"
	"path/filepath"
	"syscall"

	"github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
)

// node is a file or directory of the mount: go-fuse's loopback node, with
// every operation that the model (see the package doc) follows told to
// fsys. The loopback does the operation itself on the backing directory.
type node struct {
	*fs.LoopbackNode
	fsys *FS
}

var (
	_ fs.NodeWrapChilder    = (*node)(nil)
	_ fs.NodeFsyncer        = (*node)(nil)
	_ fs.NodeOpendirHandler = (*node)(nil)
)

// WrapChild makes every node the loopback creates a node of fsys.
func (n *node) WrapChild(ctx context.Context, ops fs.InodeEmbedder) fs.InodeEmbedder {
	return &node{LoopbackNode: ops.(*fs.LoopbackNode), fsys: n.fsys}
}

// backing is the backing path of the entry name in the directory d.
func (n *node) backing(d fs.InodeEmbedder, name string) string {
	return filepath.Join(n.fsys.data, d.EmbeddedInode().Path(nil), name)
}

// ino is n's backing inode number (see FS.data).
func (n *node) ino() uint64 { return n.StableAttr().Ino }

// Fsync records the file's size as durable and commits every change of a
// name made before it. It does not fsync the backing file: durability is
// the model's.
func (n *node) Fsync(ctx context.Context, f fs.FileHandle, flags uint32) syscall.Errno {
	var out fuse.AttrOut
	if errno := n.Getattr(ctx, f, &out); errno != 0 {
		return errno
	}
	return fs.ToErrno(n.fsys.fsynced(n.ino(), int64(out.Size)))
}

// OpendirHandle opens the loopback's handle of a directory, whose fsync
// commits every change of a name made before it.
func (n *node) OpendirHandle(ctx context.Context, flags uint32) (fs.FileHandle, uint32, syscall.Errno) {
	fh, fuseFlags, errno := n.LoopbackNode.OpendirHandle(ctx, flags)
	if errno != 0 {
		return nil, 0, errno
	}
	return &dirHandle{dirStream: fh.(dirStream), fsys: n.fsys}, fuseFlags, 0
}

// dirStream is what the bridge asks of the loopback's directory handle,
// but for its fsync.
type dirStream interface {
	fs.FileReaddirenter
	fs.FileSeekdirer
	fs.FileReleasedirer
}

// dirHandle is an open directory.
type dirHandle struct {
	dirStream
	fsys *FS
}

// Fsyncdir commits every change of a name made before it.
func (d *dirHandle) Fsyncdir(ctx context.Context, flags uint32) syscall.Errno {
	d.fsys.mu.Lock()
	defer d.fsys.mu.Unlock()
	return fs.ToErrno(d.fsys.commitLocked())
}

// Open notes a truncation by O_TRUNC.
func (n *node) Open(ctx context.Context, flags uint32) (fs.FileHandle, uint32, syscall.Errno) {
	fh, fuseFlags, errno := n.LoopbackNode.Open(ctx, flags)
	if errno == 0 && flags&syscall.O_TRUNC != 0 {
		n.fsys.truncated(n.ino(), 0)
	}
	return fh, fuseFlags, errno
}

// Setattr notes a truncation.
func (n *node) Setattr(ctx context.Context, f fs.FileHandle, in *fuse.SetAttrIn, out *fuse.AttrOut) syscall.Errno {
	errno := n.LoopbackNode.Setattr(ctx, f, in, out)
	if size, ok := in.GetSize(); ok && errno == 0 {
		n.fsys.truncated(n.ino(), int64(size))
	}
	return errno
}

// Create makes a file, never fsynced, that Cut removes unless something
// is fsynced after; opening an existing file changes no name.
func (n *node) Create(ctx context.Context, name string, flags uint32, mode uint32, out *fuse.EntryOut) (ch *fs.Inode, fh fs.FileHandle, fuseFlags uint32, errno syscall.Errno) {
	p := n.backing(n, name)
	var existed bool
	errno = n.fsys.change("", func() syscall.Errno {
		_, err := os.Lstat(p)
		existed = err == nil
		if ch, fh, fuseFlags, errno = n.LoopbackNode.Create(ctx, name, flags, mode, out); errno != 0 {
			return errno
		}
		if !existed {
			n.fsys.synced[out.Ino] = 0 // a new file, or an inode number used again
		} else if flags&syscall.O_TRUNC != 0 && n.fsys.synced[out.Ino] > 0 {
			n.fsys.synced[out.Ino] = 0
		}
		return 0
	}, func() error {
		if existed {
			return nil
		}
		return os.Remove(p)
	})
	return ch, fh, fuseFlags, errno
}

// Mkdir makes a directory that Cut removes unless something is fsynced
// after.
func (n *node) Mkdir(ctx context.Context, name string, mode uint32, out *fuse.EntryOut) (ch *fs.Inode, errno syscall.Errno) {
	errno = n.fsys.change("", func() syscall.Errno {
		ch, errno = n.LoopbackNode.Mkdir(ctx, name, mode, out)
		return errno
	}, n.remover(name))
	return ch, errno
}

// Symlink makes a symbolic link that Cut removes unless something is
// fsynced after.
func (n *node) Symlink(ctx context.Context, target, name string, out *fuse.EntryOut) (ch *fs.Inode, errno syscall.Errno) {
	errno = n.fsys.change("", func() syscall.Errno {
		ch, errno = n.LoopbackNode.Symlink(ctx, target, name, out)
		return errno
	}, n.remover(name))
	return ch, errno
}

// Link makes a hard link that Cut removes unless something is fsynced
// after.
func (n *node) Link(ctx context.Context, target fs.InodeEmbedder, name string, out *fuse.EntryOut) (ch *fs.Inode, errno syscall.Errno) {
	errno = n.fsys.change("", func() syscall.Errno {
		ch, errno = n.LoopbackNode.Link(ctx, target, name, out)
		return errno
	}, n.remover(name))
	return ch, errno
}

// Mknod makes a node that Cut removes unless something is fsynced after.
func (n *node) Mknod(ctx context.Context, name string, mode, rdev uint32, out *fuse.EntryOut) (ch *fs.Inode, errno syscall.Errno) {
	errno = n.fsys.change("", func() syscall.Errno {
		ch, errno = n.LoopbackNode.Mknod(ctx, name, mode, rdev, out)
		return errno
	}, n.remover(name))
	return ch, errno
}

// remover undoes the making of the entry name in n.
func (n *node) remover(name string) func() error {
	p := n.backing(n, name)
	return func() error { return os.Remove(p) }
}

// Unlink removes a file that Cut puts back unless something is fsynced
// after.
func (n *node) Unlink(ctx context.Context, name string) syscall.Errno {
	return n.fsys.change(n.backing(n, name), func() syscall.Errno {
		return n.LoopbackNode.Unlink(ctx, name)
	}, func() error { return nil })
}

// Rmdir removes a directory that Cut makes again unless something is
// fsynced after.
func (n *node) Rmdir(ctx context.Context, name string) syscall.Errno {
	return n.fsys.change(n.backing(n, name), func() syscall.Errno {
		return n.LoopbackNode.Rmdir(ctx, name)
	}, func() error { return nil })
}

// Rename moves a file that Cut moves back unless something is fsynced
// after, putting back the file it replaced. RENAME_EXCHANGE, which no
// server under test uses, is refused rather than modelled.
func (n *node) Rename(ctx context.Context, name string, newParent fs.InodeEmbedder, newName string, flags uint32) syscall.Errno {
	const renameExchange = 2 // RENAME_EXCHANGE in linux/fs.h
	if flags&renameExchange != 0 {
		return syscall.EINVAL
	}
	from, to := n.backing(n, name), n.backing(newParent, newName)
	return n.fsys.change(to, func() syscall.Errno {
		return n.LoopbackNode.Rename(ctx, name, newParent, newName, flags)
	}, func() error { return os.Rename(to, from) })
}

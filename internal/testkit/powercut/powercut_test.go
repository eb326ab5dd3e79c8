package powercut

import (
	"errors"
	"fmt"
	iofs "io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/idempotency-go/idempotency/internal/testkit/testserver"
)

// unavailable skips t for want of what it needs, or fails it when
// IDEMPOTENCY_REQUIRE_SERVERS=1, as testserver does for a missing server.
func unavailable(t *testing.T, format string, args ...any) {
	t.Helper()
	msg := fmt.Sprintf(format, args...)
	if testserver.Require() {
		t.Fatalf("%s (%s=1, so this is a failure rather than a skip)", msg, testserver.RequireEnv)
	}
	t.Skipf("%s (skipping; set %s=1 to make this a failure)", msg, testserver.RequireEnv)
}

// mount mounts an FS in a temporary directory, unmounted when t ends, or
// skips t (see unavailable) on a machine that cannot mount FUSE.
func mount(t *testing.T) *FS {
	t.Helper()
	if _, err := os.Stat("/dev/fuse"); err != nil {
		unavailable(t, "powercut: no /dev/fuse: %v", err)
	}
	if _, err := exec.LookPath("fusermount3"); err != nil {
		if _, err := exec.LookPath("fusermount"); err != nil {
			unavailable(t, "powercut: neither fusermount3 nor fusermount on PATH; install fuse3 (Debian: apt-get install fuse3)")
		}
	}
	f, err := Mount(t.TempDir())
	if err != nil {
		unavailable(t, "%v", err)
	}
	// Registered after t.TempDir, so it runs before the directory goes.
	t.Cleanup(func() {
		if err := f.Close(); err != nil {
			t.Error(err)
		}
	})
	return f
}

// write creates (or truncates) name in f's mount with content, fsynced if
// sync says so.
func write(t *testing.T, f *FS, name, content string, sync bool) {
	t.Helper()
	file, err := os.Create(filepath.Join(f.Dir, name))
	if err != nil {
		t.Fatal(err)
	}
	defer file.Close()
	if _, err := file.WriteString(content); err != nil {
		t.Fatal(err)
	}
	if sync {
		if err := file.Sync(); err != nil {
			t.Fatal(err)
		}
	}
}

// fsyncDir fsyncs the directory name of f's mount ("" for its root).
func fsyncDir(t *testing.T, f *FS, name string) {
	t.Helper()
	d, err := os.Open(filepath.Join(f.Dir, name))
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	if err := d.Sync(); err != nil {
		t.Fatal(err)
	}
}

// content is name's content in f's mount, or "(none)" when it is missing.
func content(t *testing.T, f *FS, name string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(f.Dir, name))
	if errors.Is(err, iofs.ErrNotExist) {
		return "(none)"
	}
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// TestModel checks what Cut keeps (see the package doc): data up to the
// last fsync, names up to the last fsync of anything, renames undone when
// nothing was fsynced after them.
func TestModel(t *testing.T) {
	f := mount(t)
	write(t, f, "synced", "kept", true)
	appendTo(t, f, "synced", " lost")
	write(t, f, "manifest", "old", true)
	write(t, f, "unsynced-committed", "lost", false)
	write(t, f, "gone", "removed", true)
	if err := os.Mkdir(filepath.Join(f.Dir, "dir"), 0o755); err != nil {
		t.Fatal(err)
	}
	fsyncDir(t, f, "") // commits every name above
	write(t, f, "manifest.tmp", "new", true)
	rename(t, f, "manifest.tmp", "manifest")
	if err := os.Remove(filepath.Join(f.Dir, "gone")); err != nil {
		t.Fatal(err)
	}
	write(t, f, "dir/uncommitted", "lost", false)
	if err := f.Cut(); err != nil {
		t.Fatal(err)
	}
	for name, want := range map[string]string{
		"synced": "kept", "unsynced-committed": "", "manifest": "old", "manifest.tmp": "new",
		"gone": "removed", "dir/uncommitted": "(none)",
	} {
		if got := content(t, f, name); got != want {
			t.Errorf("after the cut %s holds %q, want %q", name, got, want)
		}
	}

	// The same rename, followed by a directory fsync, is kept.
	rename(t, f, "manifest.tmp", "manifest")
	fsyncDir(t, f, "")
	if err := f.Cut(); err != nil {
		t.Fatal(err)
	}
	if got, tmp := content(t, f, "manifest"), content(t, f, "manifest.tmp"); got != "new" || tmp != "(none)" {
		t.Errorf("after a rename and a directory fsync, the cut left manifest %q and manifest.tmp %q; want \"new\" and none", got, tmp)
	}
}

// appendTo appends s to name in f's mount, without an fsync.
func appendTo(t *testing.T, f *FS, name, s string) {
	t.Helper()
	file, err := os.OpenFile(filepath.Join(f.Dir, name), os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer file.Close()
	if _, err := file.WriteString(s); err != nil {
		t.Fatal(err)
	}
}

// rename renames from to to in f's mount.
func rename(t *testing.T, f *FS, from, to string) {
	t.Helper()
	if err := os.Rename(filepath.Join(f.Dir, from), filepath.Join(f.Dir, to)); err != nil {
		t.Fatal(err)
	}
}

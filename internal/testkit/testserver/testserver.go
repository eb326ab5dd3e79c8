// Package testserver starts throwaway real servers (redis-server, a Redis
// Cluster, PostgreSQL) on free loopback ports for tests, and stops them when
// the test ends. LaunchRedis and LaunchPostgres do the same for programs
// that are not tests, such as the benchmark, and return errors instead.
//
// IDEMPOTENCY_REDIS_SERVER=valkey-server (RedisServerEnv) runs another
// Redis-compatible server in place of redis-server, standalone and in a
// cluster, with its own command-line tool (valkey-cli).
//
// A missing server binary skips the test with a message naming the binary and
// how to install it, unless IDEMPOTENCY_REQUIRE_SERVERS=1, in which case the
// test fails: CI sets it so that a broken image cannot turn the real-server
// tests into silent skips.
//
// Every function that takes a testing.TB reports problems with t.Fatal and so
// must be called from the test's own goroutine.
package testserver

import (
	"bytes"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// RequireEnv is the environment variable that turns a missing server binary
// from a skip into a failure.
const RequireEnv = "IDEMPOTENCY_REQUIRE_SERVERS"

// Require reports whether IDEMPOTENCY_REQUIRE_SERVERS=1, that is whether a
// missing server binary must fail the test rather than skip it.
func Require() bool {
	return os.Getenv(RequireEnv) == "1"
}

// unavailable skips the test, or fails it when servers are required. It
// never returns.
func unavailable(t testing.TB, format string, args ...any) {
	t.Helper()
	msg := fmt.Sprintf(format, args...)
	if Require() {
		t.Fatalf("%s (%s=1, so this is a failure rather than a skip)", msg, RequireEnv)
	}
	t.Skipf("%s (skipping; set %s=1 to make this a failure)", msg, RequireEnv)
}

// notInstalled is the error of a binary or user that a server needs and the
// machine lacks: a test skips on it (see unavailable), where any other
// failure to start a server fails the test.
type notInstalled string

func (e notInstalled) Error() string { return string(e) }

// fail ends the test for err, the error of a starter: a skip when err says
// something is not installed (see unavailable), a failure otherwise.
func fail(t testing.TB, err error) {
	t.Helper()
	var ni notInstalled
	if errors.As(err, &ni) {
		unavailable(t, "%s", ni)
	}
	t.Fatalf("%v", err)
}

// findBinary finds name on PATH, or says that it is not installed and how
// to install it (hint).
func findBinary(name, hint string) (string, error) {
	p, err := exec.LookPath(name)
	if err != nil {
		return "", notInstalled(fmt.Sprintf("testserver: %s not found on PATH; %s", name, hint))
	}
	return p, nil
}

// lookBinary is findBinary for a test: a missing binary skips or fails it.
func lookBinary(t testing.TB, name, hint string) string {
	t.Helper()
	p, err := findBinary(name, hint)
	if err != nil {
		fail(t, err)
	}
	return p
}

// postgresBinary is findBinary that also searches
// /usr/lib/postgresql/*/bin (newest version first), because Debian's
// PostgreSQL packages keep initdb and pg_ctl off PATH.
func postgresBinary(name string) (string, error) {
	p, err := findPostgresBinary(name)
	if err != nil {
		return "", notInstalled(fmt.Sprintf("testserver: %s not found on PATH or in /usr/lib/postgresql/*/bin; %s", name, postgresHint))
	}
	return p, nil
}

// lookPostgresBinary is postgresBinary for a test: a missing binary skips or
// fails it.
func lookPostgresBinary(t testing.TB, name string) string {
	t.Helper()
	p, err := postgresBinary(name)
	if err != nil {
		fail(t, err)
	}
	return p
}

func findPostgresBinary(name string) (string, error) {
	if p, err := exec.LookPath(name); err == nil {
		return p, nil
	}
	matches, _ := filepath.Glob(filepath.Join("/usr/lib/postgresql", "*", "bin", name))
	// Sort by the numeric version directory so that 15 beats 9.6.
	slices.SortFunc(matches, func(a, b string) int {
		return compareVersions(pgVersionOf(b), pgVersionOf(a))
	})
	for _, m := range matches {
		if fi, err := os.Stat(m); err == nil && !fi.IsDir() && fi.Mode()&0o111 != 0 {
			return m, nil
		}
	}
	return "", fmt.Errorf("%s: %w", name, exec.ErrNotFound)
}

// pgVersionOf extracts "15" from /usr/lib/postgresql/15/bin/initdb.
func pgVersionOf(path string) string {
	return filepath.Base(filepath.Dir(filepath.Dir(path)))
}

func compareVersions(a, b string) int {
	as, bs := strings.Split(a, "."), strings.Split(b, ".")
	for i := 0; i < max(len(as), len(bs)); i++ {
		var x, y int
		if i < len(as) {
			x, _ = strconv.Atoi(as[i])
		}
		if i < len(bs) {
			y, _ = strconv.Atoi(bs[i])
		}
		if x != y {
			return x - y
		}
	}
	return 0
}

// freePorts returns n distinct ports that were free on 127.0.0.1 a moment
// ago. All listeners stay open until every port is chosen, so the kernel
// cannot hand out the same port twice; another process can still take one
// before the server binds it, which is why the starters retry on EADDRINUSE.
func freePorts(n int) ([]int, error) {
	ports := make([]int, 0, n)
	for range n {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, fmt.Errorf("testserver: finding a free port: %w", err)
		}
		defer l.Close()
		ports = append(ports, l.Addr().(*net.TCPAddr).Port)
	}
	return ports, nil
}

// newProcAttr puts the child in its own process group, so that killing the
// group also kills anything it forked, and asks the kernel to SIGKILL it if
// the test binary dies without running cleanups (a test timeout panics and
// exits without them).
func newProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
}

// killGroup sends sig to the process group led by pid. ESRCH means the group
// is already gone, which is what the caller wanted.
func killGroup(pid int, sig syscall.Signal) error {
	if err := syscall.Kill(-pid, sig); err != nil && !errors.Is(err, syscall.ESRCH) {
		return err
	}
	return nil
}

// readinessDeadline bounds every wait for a server to come up. Generous,
// because a loaded CI machine running tests with -race in parallel is slow,
// yet short enough that a broken server fails the test quickly.
const readinessDeadline = 20 * time.Second

// pollInterval is short because servers usually come up in milliseconds.
const pollInterval = 10 * time.Millisecond

// tail returns at most the last n bytes of b, cut at a line start, so failure
// messages show the server's final words rather than its banner.
func tail(b []byte, n int) string {
	if len(b) <= n {
		return string(b)
	}
	b = b[len(b)-n:]
	if i := bytes.IndexByte(b, '\n'); i >= 0 {
		b = b[i+1:]
	}
	return "...\n" + string(b)
}

// readLog returns the tail of a log file for a failure message.
func readLog(path string) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return fmt.Sprintf("(cannot read log %s: %v)", path, err)
	}
	if len(b) == 0 {
		return "(log is empty)"
	}
	return tail(b, 8<<10)
}

// processAlive reports whether pid exists and is not a zombie; an exited
// child of another parent can linger as a zombie until that parent reaps it.
func processAlive(pid int) bool {
	if err := syscall.Kill(pid, 0); errors.Is(err, syscall.ESRCH) {
		return false
	}
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	// The state follows the parenthesised command name.
	s := string(stat)
	if i := strings.LastIndexByte(s, ')'); i >= 0 && i+2 < len(s) {
		return s[i+2] != 'Z'
	}
	return true
}

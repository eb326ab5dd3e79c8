package testserver

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

const postgresHint = "install PostgreSQL server binaries (Debian/Ubuntu: apt-get install postgresql; macOS: brew install postgresql)"

// Postgres is a PostgreSQL server owned by one test (StartPostgres), or by
// a program until it calls stop (LaunchPostgres), with trust authentication
// for the superuser "postgres". It is stopped and its data directory removed
// when the test ends, or by stop.
type Postgres struct {
	// DSN connects as postgres to the postgres database over TCP, e.g.
	// "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable".
	DSN string
	// Port is the TCP port on 127.0.0.1.
	Port int
	// Dir is the data directory, which also holds the Unix socket and the
	// server log. It survives Stop and Restart.
	Dir string

	pgctl    string
	asUser   []string // command prefix that drops root, or nil
	settings []string // PostgresConfig.Settings, each passed as -c
}

// StartPostgres initialises a fresh cluster with initdb, starts it with
// pg_ctl on a free loopback port with fsync off, and waits until it accepts
// connections. initdb refuses to run as root, so when the test runs as root
// both run as the postgres user via runuser.
//
// pg_ctl detaches the server into its own session, so unlike redis-server it
// outlives a test binary that dies without running cleanups (SIGKILL, or the
// panic of go test -timeout); stop such a leftover with
// pg_ctl -D <dir> -m immediate stop.
func StartPostgres(t testing.TB) *Postgres {
	t.Helper()
	return startPostgres(t, PostgresConfig{})
}

// startPostgres does the work of StartPostgres and StartPostgresWith.
func startPostgres(t testing.TB, cfg PostgresConfig) *Postgres {
	t.Helper()
	p, stop, err := launchPostgres(t.Logf, cfg)
	if err != nil {
		fail(t, err)
	}
	t.Cleanup(func() {
		if err := stop(); err != nil {
			t.Errorf("%v", err)
		}
	})
	// Registered after the stop, so it runs first, while the log exists.
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("testserver: postgres %d log:\n%s", p.Port, readLog(p.logPath()))
		}
	})
	return p
}

// LaunchPostgres is StartPostgres for a program that is not a test: missing
// binaries or a failed start are returned as an error, and the server runs
// until stop, which stops it and removes its data directory, is called. As
// with StartPostgres, a program killed before it calls stop leaves the
// server running.
func LaunchPostgres() (p *Postgres, stop func() error, err error) {
	return launchPostgres(func(string, ...any) {}, PostgresConfig{})
}

// launchPostgres does the work of StartPostgres. logf hears what stop had to
// do when pg_ctl could not stop the server. On error no server runs and the
// directory is gone.
func launchPostgres(logf func(format string, args ...any), cfg PostgresConfig) (p *Postgres, stop func() error, err error) {
	initdb, err := postgresBinary("initdb")
	if err != nil {
		return nil, nil, err
	}
	pgctl, err := postgresBinary("pg_ctl")
	if err != nil {
		return nil, nil, err
	}

	var asUser []string // command prefix that drops root
	var uid, gid = -1, -1
	if os.Geteuid() == 0 {
		runuser, err := findBinary("runuser", "running as root, testserver needs it to run initdb as the postgres user (initdb refuses root); install util-linux")
		if err != nil {
			return nil, nil, err
		}
		u, err := user.Lookup("postgres")
		if err != nil {
			return nil, nil, notInstalled(fmt.Sprintf("testserver: running as root, and initdb refuses root, but there is no postgres user to run it as (%v); create one, e.g. useradd --system postgres", err))
		}
		uid, _ = strconv.Atoi(u.Uid)
		gid, _ = strconv.Atoi(u.Gid)
		asUser = []string{runuser, "-u", "postgres", "--"}
	}

	// Not t.TempDir: its parents are 0700 and owned by root, so the postgres
	// user could not reach it.
	dir, err := os.MkdirTemp(tempBase(uid), "testserver-pg-")
	if err != nil {
		return nil, nil, fmt.Errorf("testserver: %w", err)
	}
	removeDir := func() error {
		if err := os.RemoveAll(dir); err != nil {
			return fmt.Errorf("testserver: removing %s: %w", dir, err)
		}
		return nil
	}
	if strings.ContainsAny(dir, "'\"\\ ") {
		// pg_ctl hands -o to /bin/sh; a plain temp path needs no quoting.
		return nil, nil, errors.Join(fmt.Errorf("testserver: temp dir %q needs shell quoting; set TMPDIR to a plain path", dir), removeDir())
	}
	if uid >= 0 {
		if err := os.Chown(dir, uid, gid); err != nil {
			return nil, nil, errors.Join(fmt.Errorf("testserver: chown %s to postgres: %w", dir, err), removeDir())
		}
	}

	p = &Postgres{Dir: dir, pgctl: pgctl, asUser: asUser, settings: cfg.Settings}
	out, err := p.run(60*time.Second, initdb, "-D", dir, "-U", "postgres", "-A", "trust",
		"--no-sync", "-E", "UTF8", "--locale=C")
	if err != nil {
		return nil, nil, errors.Join(fmt.Errorf("testserver: initdb: %v\n%s", err, tail(out, 8<<10)), removeDir())
	}
	if err := writeDataFiles(dir, uid, gid, cfg.Files); err != nil {
		return nil, nil, errors.Join(err, removeDir())
	}

	// Also run when a start fails, which may leave the server half up.
	stop = func() error {
		if err := p.stop(); err != nil {
			// pg_ctl stop failed: kill whatever postmaster.pid still names.
			if pid := postmasterPID(dir); pid > 0 {
				if kerr := syscall.Kill(pid, syscall.SIGKILL); kerr == nil {
					logf("testserver: %v; killed postmaster %d", err, pid)
				}
			}
		}
		return removeDir()
	}

	const attempts = 5
	for attempt := 1; ; attempt++ {
		ports, err := freePorts(1)
		if err != nil {
			return nil, nil, errors.Join(err, stop())
		}
		p.Port = ports[0]
		p.DSN = fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable", p.Port)
		err = p.start()
		if err == nil {
			return p, stop, nil
		}
		if !strings.Contains(readLog(p.logPath()), "Address already in use") || attempt == attempts {
			return nil, nil, errors.Join(err, stop())
		}
	}
}

// run runs bin as the server's user, in the data directory.
func (p *Postgres) run(timeout time.Duration, bin string, args ...string) ([]byte, error) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	argv := append(append(slices.Clone(p.asUser), bin), args...)
	cmd := exec.CommandContext(ctx, argv[0], argv[1:]...)
	// The postgres user may not be able to enter the caller's working
	// directory; the data directory is its own.
	cmd.Dir = p.Dir
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.Cancel = func() error { return killGroup(cmd.Process.Pid, syscall.SIGKILL) }
	// pg_ctl's postmaster could inherit our output pipe and keep it open
	// for its whole life; -l prevents that, WaitDelay guards it.
	cmd.WaitDelay = 2 * time.Second
	return cmd.CombinedOutput()
}

// start starts the server on p.Port and waits until it accepts connections.
func (p *Postgres) start() error {
	opts := fmt.Sprintf("-p %d -k '%s' -c listen_addresses=127.0.0.1 -c fsync=off", p.Port, p.Dir)
	for _, s := range p.settings {
		opts += " -c " + s
	}
	out, err := p.run(60*time.Second, p.pgctl, "-D", p.Dir, "-l", p.logPath(), "-w", "-t", "30", "-o", opts, "start")
	if err == nil {
		err = waitPostgres(p.Port)
	}
	if err != nil {
		return fmt.Errorf("testserver: pg_ctl start on port %d: %v\n%s\n%s", p.Port, err, bytes.TrimSpace(out), readLog(p.logPath()))
	}
	return nil
}

// stop shuts the server down in immediate mode and waits until the
// postmaster is gone: pg_ctl returns once postmaster.pid is, which the
// postmaster removes just before it exits.
func (p *Postgres) stop() error {
	pid := postmasterPID(p.Dir)
	if out, err := p.run(30*time.Second, p.pgctl, "-D", p.Dir, "-m", "immediate", "-w", "stop"); err != nil {
		return fmt.Errorf("testserver: pg_ctl stop: %v: %s", err, bytes.TrimSpace(out))
	}
	for deadline := time.Now().Add(readinessDeadline); pid > 0 && processAlive(pid); time.Sleep(pollInterval) {
		if time.Now().After(deadline) {
			return fmt.Errorf("testserver: postmaster %d still runs %v after pg_ctl stop", pid, readinessDeadline)
		}
	}
	return nil
}

// Stop shuts the server down as a crash would, with pg_ctl stop -m
// immediate: every backend is killed without a checkpoint and every
// connection reset. What was committed survives and Restart recovers it
// from the WAL (fsync is off, which loses data only if the machine goes
// down, not the server). Calling it on a stopped server does nothing.
func (p *Postgres) Stop(t testing.TB) {
	t.Helper()
	if postmasterPID(p.Dir) == 0 {
		return
	}
	if err := p.stop(); err != nil {
		t.Fatalf("%v", err)
	}
}

// Restart starts the server again on the same port and data directory,
// stopping it first as Stop does if it runs, and waits until it accepts
// connections, crash recovery done. If another process took the port
// meanwhile, it retries for a few seconds and then fails the test.
func (p *Postgres) Restart(t testing.TB) {
	t.Helper()
	p.Stop(t)
	const attempts = 10
	for attempt := 1; ; attempt++ {
		err := p.start()
		if err == nil {
			return
		}
		if !strings.Contains(readLog(p.logPath()), "Address already in use") || attempt == attempts {
			t.Fatalf("testserver: restarting postgres: %v", err)
		}
		time.Sleep(300 * time.Millisecond)
	}
}

// logPath is the server log of the run on p.Port.
func (p *Postgres) logPath() string {
	return filepath.Join(p.Dir, fmt.Sprintf("postgres-%d.log", p.Port))
}

// waitPostgres confirms over TCP what pg_ctl -w saw through postmaster.pid.
// pg_isready is optional: without it, pg_ctl -w is the readiness check.
func waitPostgres(port int) error {
	isready, err := findPostgresBinary("pg_isready")
	if err != nil {
		return nil
	}
	deadline := time.Now().Add(readinessDeadline)
	for {
		out, err := exec.Command(isready, "-h", "127.0.0.1", "-p", strconv.Itoa(port),
			"-U", "postgres", "-d", "postgres", "-t", "1").CombinedOutput()
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("pg_isready: %v: %s", err, bytes.TrimSpace(out))
		}
		time.Sleep(pollInterval)
	}
}

// postmasterPID reads the first line of DIR/postmaster.pid, or returns 0. A
// stale file may name a pid since reused by another program, so the pid only
// counts if that process is a postgres whose command line names dir.
func postmasterPID(dir string) int {
	b, err := os.ReadFile(filepath.Join(dir, "postmaster.pid"))
	if err != nil {
		return 0
	}
	line, _, _ := strings.Cut(string(b), "\n")
	pid, err := strconv.Atoi(strings.TrimSpace(line))
	if err != nil || pid <= 0 {
		return 0
	}
	cmdline, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
	if err != nil || !bytes.Contains(cmdline, []byte("postgres")) || !bytes.Contains(cmdline, []byte(dir)) {
		return 0
	}
	return pid
}

// tempBase returns os.TempDir, or /tmp when running as root with a TMPDIR
// the postgres user (uid >= 0) cannot traverse.
func tempBase(uid int) string {
	base := os.TempDir()
	if uid < 0 {
		return base
	}
	for d := base; ; d = filepath.Dir(d) {
		fi, err := os.Stat(d)
		if err != nil || fi.Mode().Perm()&0o001 == 0 {
			return "/tmp"
		}
		if d == filepath.Dir(d) {
			return base
		}
	}
}

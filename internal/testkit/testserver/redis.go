package testserver

import (
	"bufio"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// RedisServerEnv is the environment variable that picks the server binary
// StartRedis, LaunchRedis and StartCluster run: a name on PATH or a path,
// such as valkey-server; redis-server when it is unset or empty. The
// cluster is created with the command-line tool of the same name ending in
// -cli (valkey-cli), found beside the server when the variable holds a path.
const RedisServerEnv = "IDEMPOTENCY_REDIS_SERVER"

// RedisServer returns the server binary the starters run:
// $IDEMPOTENCY_REDIS_SERVER, or redis-server.
func RedisServer() string {
	if s := os.Getenv(RedisServerEnv); s != "" {
		return s
	}
	return "redis-server"
}

// redisCLI returns the command-line tool that goes with server:
// valkey-cli for valkey-server, in the same directory when server is a
// path; redis-cli for a server whose name does not end in -server.
func redisCLI(server string) string {
	dir, base := filepath.Split(server)
	name, ok := strings.CutSuffix(base, "-server")
	if !ok {
		return "redis-cli"
	}
	return dir + name + "-cli"
}

// redisHint says how to install name, the server or its tool.
func redisHint(name string) string {
	if strings.HasPrefix(filepath.Base(name), "valkey-") {
		return "install Valkey 8 (Debian bookworm: apt-get install -t bookworm-backports valkey-server; macOS: brew install valkey)"
	}
	return "install Redis 7 (Debian/Ubuntu: apt-get install redis-server; macOS: brew install redis), or name another server in " + RedisServerEnv
}

// Redis is a redis-server process (or the server RedisServerEnv names) owned
// by one test (StartRedis), or by a program until it calls stop
// (LaunchRedis). It is killed and its directory removed when the test ends,
// or by stop.
type Redis struct {
	// Addr is "127.0.0.1:port"; it stays the same across Restart.
	Addr string
	// Port is the port part of Addr.
	Port int
	// Dir is the server's working directory. It survives Stop and Restart,
	// so a cluster node keeps its nodes.conf and rejoins the cluster with
	// the same identity.
	Dir string

	t       testing.TB // nil for a server from LaunchRedis
	bin     string
	args    []string
	logPath string

	mu   sync.Mutex
	proc *redisProc // nil while stopped
}

// redisProc is one run of the server process.
type redisProc struct {
	cmd  *exec.Cmd
	done chan struct{} // closed once the process has exited and been reaped
	err  error         // Wait's result, readable after done is closed
}

// StartRedis starts a standalone redis-server on a free loopback port with
// persistence off and waits until it answers PING. extraArgs are appended to
// the command line (for example "--notify-keyspace-events", "KEA") and so
// override the defaults.
func StartRedis(t testing.TB, extraArgs ...string) *Redis {
	t.Helper()
	return startRedis(t, 1, func([]int, string) []string { return extraArgs })
}

// LaunchRedis is StartRedis for a program that is not a test: a missing
// redis-server or a failed start is returned as an error, and the server
// runs until stop, which kills it and removes its directory, is called.
// Methods that take a testing.TB report to the one they are given.
func LaunchRedis(extraArgs ...string) (r *Redis, stop func() error, err error) {
	return LaunchServer(RedisServer(), extraArgs...)
}

// LaunchServer is LaunchRedis with the server binary server (a name on
// PATH or a path), whatever RedisServerEnv says: a program that measures
// two servers side by side starts each by name.
func LaunchServer(server string, extraArgs ...string) (r *Redis, stop func() error, err error) {
	dir, err := os.MkdirTemp("", "testserver-redis-")
	if err != nil {
		return nil, nil, fmt.Errorf("testserver: %w", err)
	}
	r, err = launchRedis(dir, server, 1, func([]int, string) []string { return extraArgs })
	if err != nil {
		return nil, nil, errors.Join(err, os.RemoveAll(dir))
	}
	return r, func() error { return errors.Join(r.kill(), os.RemoveAll(dir)) }, nil
}

// startRedis is launchRedis in a t.TempDir, owned by t.
func startRedis(t testing.TB, nports int, extra func(ports []int, dir string) []string) *Redis {
	t.Helper()
	dir := t.TempDir()
	r, err := launchRedis(dir, RedisServer(), nports, extra)
	if err != nil {
		fail(t, err)
	}
	r.t = t
	// Registered after t.TempDir, so it runs before the directory is
	// removed: the server must be dead before its files go.
	t.Cleanup(func() {
		if err := r.kill(); err != nil {
			t.Errorf("testserver: stopping redis %s: %v", r.Addr, err)
		}
		if t.Failed() {
			t.Logf("testserver: redis %s log:\n%s", r.Addr, readLog(r.logPath))
		}
	})
	return r
}

// launchRedis starts a server in dir using nports fresh ports (the first is
// the client port); more gives the caller ports for, say, the cluster bus.
// extra builds the arguments that depend on those ports and the directory.
// A bind conflict, which happens when another process grabs a port between
// freePorts and the server's bind, is retried with new ports. On error no
// server runs.
func launchRedis(dir, server string, nports int, extra func(ports []int, dir string) []string) (*Redis, error) {
	bin, err := findBinary(server, redisHint(server))
	if err != nil {
		return nil, err
	}
	r := &Redis{bin: bin, Dir: dir}
	const attempts = 5
	for attempt := 1; ; attempt++ {
		ports, err := freePorts(nports)
		if err != nil {
			return nil, err
		}
		r.Port = ports[0]
		r.Addr = net.JoinHostPort("127.0.0.1", strconv.Itoa(r.Port))
		r.logPath = filepath.Join(dir, fmt.Sprintf("redis-%d.log", r.Port))
		r.args = append([]string{
			"--port", strconv.Itoa(r.Port),
			"--bind", "127.0.0.1",
			"--dir", dir,
			"--save", "",
			"--appendonly", "no",
			"--daemonize", "no",
			// Redis 7 waits 5 s by default before a diskless full sync, hoping
			// more replicas arrive; that would make every cluster with
			// replicas take 5 s longer to come up.
			"--repl-diskless-sync-delay", "0",
		}, extra(ports, dir)...)
		err = r.start()
		if err == nil {
			return r, nil
		}
		if !addrInUse(r.logPath) || attempt == attempts {
			return nil, fmt.Errorf("testserver: %s on %s did not start: %v\n%s", filepath.Base(r.bin), r.Addr, err, readLog(r.logPath))
		}
	}
}

// start runs the server process and waits until it answers PING. On error
// the process is already dead.
func (r *Redis) start() error {
	logf, err := os.OpenFile(r.logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	cmd := exec.Command(r.bin, r.args...)
	cmd.Dir = r.Dir
	// A file rather than a pipe: os/exec then needs no copying goroutine, and
	// the log outlives the process for failure messages.
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = newProcAttr()
	err = cmd.Start()
	logf.Close()
	if err != nil {
		return err
	}
	p := &redisProc{cmd: cmd, done: make(chan struct{})}
	go func() {
		p.err = cmd.Wait()
		close(p.done)
	}()

	r.mu.Lock()
	r.proc = p
	r.mu.Unlock()

	if err := waitRedis(r.Addr, p); err != nil {
		r.kill()
		return err
	}
	return nil
}

// waitRedis polls addr with PING until it answers PONG, the process exits or
// the deadline passes.
func waitRedis(addr string, p *redisProc) error {
	deadline := time.Now().Add(readinessDeadline)
	var last error
	for {
		select {
		case <-p.done:
			return fmt.Errorf("the server exited: %v", p.err)
		default:
		}
		if last = pingRedis(addr); last == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("not ready after %v: %v", readinessDeadline, last)
		}
		time.Sleep(pollInterval)
	}
}

// pingRedis speaks raw RESP instead of using go-redis so that readiness does
// not depend on client handshakes (HELLO, CLIENT SETINFO) or retry policies.
func pingRedis(addr string) error {
	c, err := net.DialTimeout("tcp", addr, 250*time.Millisecond)
	if err != nil {
		return err
	}
	defer c.Close()
	if err := c.SetDeadline(time.Now().Add(time.Second)); err != nil {
		return err
	}
	if _, err := c.Write([]byte("PING\r\n")); err != nil {
		return err
	}
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		return err
	}
	if line != "+PONG\r\n" {
		return fmt.Errorf("PING answered %q", strings.TrimSpace(line))
	}
	return nil
}

func addrInUse(logPath string) bool {
	b, _ := os.ReadFile(logPath)
	return strings.Contains(string(b), "Address already in use")
}

// kill SIGKILLs the server's process group and reaps it. It is a no-op when
// the server is stopped.
func (r *Redis) kill() error {
	r.mu.Lock()
	p := r.proc
	r.proc = nil
	r.mu.Unlock()
	if p == nil {
		return nil
	}
	if err := killGroup(p.cmd.Process.Pid, syscall.SIGKILL); err != nil {
		return err
	}
	select {
	case <-p.done:
		return nil
	case <-time.After(10 * time.Second):
		return errors.New("the server did not exit 10 s after SIGKILL")
	}
}

// running returns the live process, or nil.
func (r *Redis) running() *redisProc {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.proc
}

// pid returns the server's process id, or 0 while it is stopped.
func (r *Redis) pid() int {
	if p := r.running(); p != nil {
		return p.cmd.Process.Pid
	}
	return 0
}

// Stop kills the server with SIGKILL, as an outage would: no shutdown hooks,
// connections reset. Calling it on a stopped server does nothing.
func (r *Redis) Stop(t testing.TB) {
	t.Helper()
	if err := r.kill(); err != nil {
		t.Fatalf("testserver: stopping redis %s: %v", r.Addr, err)
	}
}

// Restart starts the server again on the same address and directory and
// waits until it answers PING, which it does once it has loaded what it
// persisted; it kills the running process first if there is one. By default
// data is lost, as persistence is off; a server started with, say,
// "--appendonly", "yes" reloads its append-only file. A cluster node keeps
// its nodes.conf and rejoins the cluster. If another process took the port
// meanwhile, it retries for a few seconds and then fails the test.
func (r *Redis) Restart(t testing.TB) {
	t.Helper()
	r.Stop(t)
	if f, err := os.OpenFile(r.logPath, os.O_WRONLY|os.O_APPEND, 0); err == nil {
		fmt.Fprintf(f, "--- testserver: restart at %s ---\n", time.Now().Format(time.RFC3339Nano))
		f.Close()
	}
	const attempts = 10
	for attempt := 1; ; attempt++ {
		err := r.start()
		if err == nil {
			return
		}
		if !addrInUse(r.logPath) || attempt == attempts {
			t.Fatalf("testserver: restarting %s on %s: %v\n%s", filepath.Base(r.bin), r.Addr, err, readLog(r.logPath))
		}
		time.Sleep(300 * time.Millisecond)
	}
}

// Pause freezes the server with SIGSTOP: connections stay open but nothing
// answers, like a hung server or a network partition. Resume undoes it.
func (r *Redis) Pause(t testing.TB) {
	t.Helper()
	r.signal(t, syscall.SIGSTOP)
}

// Resume continues a server frozen by Pause with SIGCONT.
func (r *Redis) Resume(t testing.TB) {
	t.Helper()
	r.signal(t, syscall.SIGCONT)
}

func (r *Redis) signal(t testing.TB, sig syscall.Signal) {
	t.Helper()
	p := r.running()
	if p == nil {
		t.Fatalf("testserver: redis %s is stopped; cannot send %v", r.Addr, sig)
	}
	if err := killGroup(p.cmd.Process.Pid, sig); err != nil {
		t.Fatalf("testserver: sending %v to redis %s: %v", sig, r.Addr, err)
	}
}

// Client returns a new go-redis client for Addr with default options. It is
// closed when the test that started the server ends; the caller closes the
// client of a server from LaunchRedis.
func (r *Redis) Client() *redis.Client {
	c := redis.NewClient(&redis.Options{Addr: r.Addr})
	if r.t != nil {
		r.t.Cleanup(func() { _ = c.Close() })
	}
	return c
}

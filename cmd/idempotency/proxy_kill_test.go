package main

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"os"
	"os/exec"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/idempotency-go/idempotency/internal/testkit/report"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// proxyProcess is `idempotency proxy` running as a process of its own, so
// that it can be killed with SIGKILL and started again on its address: this
// test binary, which TestMain turns into the command.
type proxyProcess struct {
	args   []string
	addr   string // its clients' address, the same across restarts
	admin  string // its admin address, if it has one
	mu     sync.Mutex
	cmd    *exec.Cmd
	stderr bytes.Buffer
}

// asCommand in a test binary's environment makes it run as the command.
const asCommand = "IDEMPOTENCY_TEST_BINARY_AS_COMMAND=1"

// TestMain runs the command instead of the tests in a test binary started
// with asCommand, so that a test can run the command as a process without
// building it.
func TestMain(m *testing.M) {
	if slices.Contains(os.Environ(), asCommand) {
		main()
	}
	os.Exit(m.Run())
}

func startProxyProcess(t *testing.T, storeFlags []string, u upstream, args ...string) *proxyProcess {
	t.Helper()
	p := &proxyProcess{addr: "127.0.0.1:0",
		args: append(append(append([]string{}, storeFlags...), "proxy", "-upstream", u.url, "-admin-listen", "",
			"-scope-header", "X-Account-ID"), args...)}
	require.NoError(t, p.start())
	t.Cleanup(func() {
		p.mu.Lock()
		defer p.mu.Unlock()
		_ = p.cmd.Process.Kill()
		_ = p.cmd.Wait()
	})
	return p
}

// start starts the process on p.addr and waits until it serves.
func (p *proxyProcess) start() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	self, err := os.Executable()
	if err != nil {
		return err
	}
	cmd := exec.Command(self, append(append([]string{}, p.args...), "-listen", p.addr)...)
	cmd.Env = append(os.Environ(), asCommand)
	out, err := cmd.StdoutPipe()
	if err != nil {
		return err
	}
	p.stderr.Reset()
	cmd.Stderr = &p.stderr
	if err := cmd.Start(); err != nil {
		return err
	}
	p.cmd = cmd
	line, err := bufio.NewReader(out).ReadString('\n')
	m := servingLine.FindStringSubmatch(line)
	if err != nil || m == nil {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		return fmt.Errorf("the proxy did not start (%v, said %q): %s", err, line, p.stderr.String())
	}
	go func() { _, _ = io.Copy(io.Discard, out) }()
	p.addr, p.admin = m[1], m[2]
	return nil
}

// kill kills the process with SIGKILL, mid-request or not.
func (p *proxyProcess) kill() {
	p.mu.Lock()
	defer p.mu.Unlock()
	_ = p.cmd.Process.Signal(syscall.SIGKILL)
	_ = p.cmd.Wait()
}

// TestProxyKilled is the audit of the proxy under kill -9: charges go
// through three proxy processes sharing one store, one of which is killed
// with SIGKILL every few hundred milliseconds, mid-request, and started
// again; each client retries through any proxy until it gets its charge.
// Every key reaches the upstream as one operation (one operation key,
// however many attempts), so an upstream that de-duplicates on that key
// charges once; every client's answer is the one stored, which a last
// retry replays.
func TestProxyKilled(t *testing.T) {
	for _, name := range []string{"redis", "postgres"} {
		t.Run(name, func(t *testing.T) {
			s := stores(t)[name](t)
			u := startUpstream(t)
			procs := make([]*proxyProcess, 3)
			for i := range procs {
				procs[i] = startProxyProcess(t, s.flags, u, "-lease", "1s")
			}
			kills := killEvery(t, procs, 250*time.Millisecond)
			answers := chargeThrough(t, procs, 48)
			n := kills()

			stats := u.stats(t)
			forked, lost, rerun, i := 0, 0, 0, 0
			for key, got := range answers {
				ops := stats.Operations["acct_kill/"+key]
				if !assert.Len(t, ops, 1, "operation keys the upstream saw for %s", key) {
					forked++
					continue
				}
				c := decodeCharge(t, got)
				assert.Equal(t, stats.Charges[ops[0]], c.ID, "the answer to %s is its operation's charge", key)
				if stats.Calls[ops[0]] > 1 {
					rerun++
				}
				replay := post(t, "http://"+procs[i%3].addr, "/slow?ms=150", "acct_kill", key, `{"amount":5}`)
				if !assert.Equal(t, got.body, replay.body, "a retry of %s replays what its client got", key) {
					lost++
				}
				i++
			}
			t.Logf("%d charges, %d proxies killed, %d operations called the upstream again after a kill (one operation key each)", len(answers), n, rerun)
			report.Add(t, report.Entry{Suite: "faults", Store: name, Case: "proxy-kill", Faults: map[string]int{"kill": n},
				Operations: len(answers), DoubleExecutions: forked, LostCompletions: lost,
				Notes: fmt.Sprintf("%d of %d operations reached the upstream again, under their one operation key", rerun, len(answers))})
			require.GreaterOrEqual(t, n, 3, "proxies killed during the run")
		})
	}
}

// killEvery kills one of procs with SIGKILL every interval and starts it
// again, until the returned function is called; that returns the kills.
func killEvery(t *testing.T, procs []*proxyProcess, interval time.Duration) func() int {
	var kills atomic.Int64
	stop, done := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		for {
			select {
			case <-stop:
				return
			case <-time.After(interval):
			}
			p := procs[rand.IntN(len(procs))]
			p.kill()
			kills.Add(1)
			time.Sleep(interval / 4)
			assert.NoError(t, p.start(), "starting a killed proxy again")
		}
	}()
	return func() int {
		close(stop)
		<-done
		return int(kills.Load())
	}
}

// chargeThrough makes n charges, 8 at a time, each retried through any of
// procs until it gets 201, and returns each key's answer.
func chargeThrough(t *testing.T, procs []*proxyProcess, n int) map[string]answer {
	var (
		mu      sync.Mutex
		answers = map[string]answer{}
		wg      sync.WaitGroup
		next    atomic.Int64
	)
	client := &http.Client{Timeout: 10 * time.Second}
	for range 8 {
		wg.Go(func() {
			for i := int(next.Add(1)); i <= n; i = int(next.Add(1)) {
				key := fmt.Sprintf("kill-%d", i)
				a, ok := chargeUntilDone(client, procs, key, time.Now().Add(60*time.Second))
				if !assert.True(t, ok, "charge %s never succeeded", key) {
					continue
				}
				mu.Lock()
				answers[key] = a
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	return answers
}

// chargeUntilDone sends one charge under key through random proxies until
// one answers 201, as a client retries: on a lost connection, a 5xx or a
// 409 (the first attempt still in flight).
func chargeUntilDone(client *http.Client, procs []*proxyProcess, key string, deadline time.Time) (answer, bool) {
	for time.Now().Before(deadline) {
		p := procs[rand.IntN(len(procs))]
		p.mu.Lock()
		addr := p.addr
		p.mu.Unlock()
		req, _ := http.NewRequest(http.MethodPost, "http://"+addr+"/slow?ms=150", strings.NewReader(`{"amount":5}`))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Idempotency-Key", key)
		req.Header.Set("X-Account-ID", "acct_kill")
		resp, err := client.Do(req)
		if err == nil {
			body, rerr := io.ReadAll(resp.Body)
			resp.Body.Close()
			if rerr == nil && resp.StatusCode == http.StatusCreated {
				return answer{resp.StatusCode, resp.Header, string(body)}, true
			}
		}
		time.Sleep(50 * time.Millisecond)
	}
	return answer{}, false
}

package testserver

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestRedis(t *testing.T) {
	ctx := context.Background()
	r := StartRedis(t)
	c := r.Client()
	require.NoError(t, c.Ping(ctx).Err())
	require.NoError(t, c.Set(ctx, "k", "v", 0).Err())

	addr := r.Addr
	r.Stop(t)
	r.Stop(t) // idempotent
	assert.Error(t, c.Ping(ctx).Err(), "PING to a stopped server")

	r.Restart(t)
	assert.Equal(t, addr, r.Addr, "Restart keeps the address")
	require.NoError(t, c.Ping(ctx).Err())
	assert.ErrorIs(t, c.Get(ctx, "k").Err(), redis.Nil, "data does not survive a restart")

	// A short read timeout and no retries make the hang visible quickly.
	impatient := redis.NewClient(&redis.Options{Addr: r.Addr, ReadTimeout: 200 * time.Millisecond, MaxRetries: -1})
	defer impatient.Close()
	require.NoError(t, impatient.Ping(ctx).Err())
	r.Pause(t)
	start := time.Now()
	err := impatient.Ping(ctx).Err()
	var netErr interface{ Timeout() bool }
	require.ErrorAs(t, err, &netErr, "PING to a paused server")
	assert.True(t, netErr.Timeout(), "PING to a paused server times out: %v", err)
	assert.Less(t, time.Since(start), 2*time.Second)
	r.Resume(t)
	require.NoError(t, impatient.Ping(ctx).Err())
}

// TestRedisRestartKeepsAppendOnlyFile kills a server that persists every
// write to its append-only file and expects Restart to bring the data back
// in a new process on the same address.
func TestRedisRestartKeepsAppendOnlyFile(t *testing.T) {
	ctx := context.Background()
	r := StartRedis(t, "--appendonly", "yes", "--appendfsync", "always")
	c := r.Client()
	require.NoError(t, c.Set(ctx, "k", "v", 0).Err())
	pid, addr := r.pid(), r.Addr

	r.Restart(t)
	assert.False(t, processAlive(pid), "the first redis-server %d was killed", pid)
	assert.NotEqual(t, pid, r.pid(), "a new process")
	assert.Equal(t, addr, r.Addr)
	got, err := c.Get(ctx, "k").Result()
	require.NoError(t, err, "the write survives in the append-only file")
	assert.Equal(t, "v", got)
}

func TestRedisExtraArgs(t *testing.T) {
	r := StartRedis(t, "--notify-keyspace-events", "KEA")
	got, err := r.Client().ConfigGet(context.Background(), "notify-keyspace-events").Result()
	require.NoError(t, err)
	assert.ElementsMatch(t, []rune("AKE"), []rune(got["notify-keyspace-events"]))
}

// TestRedisRetriesBusyPort makes the first attempt bind a port that is
// taken, as when another process grabs the free port first, and expects
// startRedis to retry on a new one.
func TestRedisRetriesBusyPort(t *testing.T) {
	busy, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer busy.Close()
	busyPort := busy.Addr().(*net.TCPAddr).Port

	calls := 0
	r := startRedis(t, 1, func([]int, string) []string {
		calls++
		if calls == 1 {
			return []string{"--port", strconv.Itoa(busyPort)} // the last --port wins
		}
		return nil
	})
	assert.Equal(t, 2, calls)
	assert.NotEqual(t, busyPort, r.Port)
	require.NoError(t, r.Client().Ping(context.Background()).Err())
}

// TestRedisCleanup checks that a server started by a test, including a
// paused one, is dead and its directory gone when the test ends.
func TestRedisCleanup(t *testing.T) {
	var pid int
	var dir string
	t.Run("inner", func(t *testing.T) {
		r := StartRedis(t)
		pid, dir = r.pid(), r.Dir
		r.Pause(t)
	})
	if pid == 0 {
		t.Skip("no server was started") // inner skipped or failed and said why
	}
	assert.False(t, processAlive(pid), "redis-server %d outlived its test", pid)
	assert.NoDirExists(t, dir)
}

// TestLaunch checks that the starters for programs run a server that
// answers, and that stop leaves neither the process nor its directory.
func TestLaunch(t *testing.T) {
	// A missing binary skips, as for StartRedis; any other error fails.
	requireLaunched := func(t *testing.T, err error) {
		var ni notInstalled
		if errors.As(err, &ni) {
			fail(t, err)
		}
		require.NoError(t, err)
	}
	t.Run("redis", func(t *testing.T) {
		r, stop, err := LaunchRedis()
		requireLaunched(t, err)
		c := r.Client()
		defer c.Close()
		require.NoError(t, c.Ping(context.Background()).Err())
		pid := r.pid()
		require.NoError(t, stop())
		assert.False(t, processAlive(pid), "redis-server %d outlived stop", pid)
		assert.NoDirExists(t, r.Dir)
	})
	t.Run("postgres", func(t *testing.T) {
		p, stop, err := LaunchPostgres()
		requireLaunched(t, err)
		pid := postmasterPID(p.Dir)
		require.NotZero(t, pid, "postmaster.pid names a live postgres")
		require.NoError(t, stop())
		assert.False(t, processAlive(pid), "postmaster %d outlived stop", pid)
		assert.NoDirExists(t, p.Dir)
	})
}

func TestCluster(t *testing.T) {
	for _, tc := range []struct{ masters, replicas int }{{3, 0}, {3, 1}} {
		t.Run(fmt.Sprintf("%dx%d", tc.masters, tc.replicas), func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			c := StartCluster(t, tc.masters, tc.replicas)
			require.Len(t, c.Nodes, tc.masters*(1+tc.replicas))
			require.Len(t, c.Addrs, len(c.Nodes))

			cc := c.Client()
			const n = 60
			for i := range n {
				require.NoError(t, cc.Set(ctx, fmt.Sprintf("key:%d", i), i, 0).Err())
			}

			// A plain client to a non-owner would get MOVED, so a successful
			// GET proves MasterFor picked the owner.
			plain := map[*Redis]*redis.Client{}
			masters := map[*Redis]bool{}
			for i := range n {
				key := fmt.Sprintf("key:%d", i)
				got, err := cc.Get(ctx, key).Int()
				require.NoError(t, err)
				assert.Equal(t, i, got)

				m := c.MasterFor(key)
				require.NotNil(t, m, key)
				masters[m] = true
				if plain[m] == nil {
					plain[m] = m.Client()
				}
				got, err = plain[m].Get(ctx, key).Int()
				require.NoError(t, err, "GET %s on MasterFor's node %s", key, m.Addr)
				assert.Equal(t, i, got)
			}
			assert.Len(t, masters, tc.masters, "keys spread over every master")

			for m := range masters {
				replica := c.ReplicaOf(m)
				if tc.replicas == 0 {
					assert.Nil(t, replica)
					continue
				}
				require.NotNil(t, replica, "replica of %s", m.Addr)
				assert.NotEqual(t, m, replica)
				info, err := replica.Client().Info(ctx, "replication").Result()
				require.NoError(t, err)
				fields := infoFields(info)
				assert.Equal(t, "slave", fields["role"])
				assert.Equal(t, strconv.Itoa(m.Port), fields["master_port"])
			}

			if tc.replicas == 0 {
				// A restarted node reads its nodes.conf from Dir and comes back
				// owning the same slots, with its data gone.
				m := c.MasterFor("key:0")
				m.Restart(t)
				c.WaitReady(t)
				assert.Equal(t, m, c.MasterFor("key:0"))
				assert.ErrorIs(t, m.Client().Get(ctx, "key:0").Err(), redis.Nil)
			}

			if tc.replicas > 0 {
				// Replication is asynchronous: poll a READONLY connection to
				// the replica of key:0's master until the key arrives.
				replica := c.ReplicaOf(c.MasterFor("key:0"))
				conn := replica.Client().Conn()
				defer conn.Close()
				require.NoError(t, conn.ReadOnly(ctx).Err())
				assert.Eventually(t, func() bool {
					v, err := conn.Get(ctx, "key:0").Result()
					return err == nil && v == "0"
				}, 5*time.Second, 10*time.Millisecond)
			}
		})
	}
}

func TestClusterNeedsThreeMasters(t *testing.T) {
	rec := &recorder{TB: t}
	rec.run(func() { StartCluster(rec, 2, 0) })
	assert.Contains(t, rec.fatal, "at least 3 masters")
}

func TestPostgres(t *testing.T) {
	psql := lookPostgresBinary(t, "psql")
	var pid int
	var dir string
	t.Run("inner", func(t *testing.T) {
		p := StartPostgres(t)
		assert.Equal(t, fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable", p.Port), p.DSN)

		out, err := exec.Command(psql, p.DSN, "-XAtc", "SELECT 1").CombinedOutput()
		require.NoError(t, err, "%s", out)
		assert.Equal(t, "1", strings.TrimSpace(string(out)))

		pid, dir = postmasterPID(p.Dir), p.Dir
		require.NotZero(t, pid, "postmaster.pid names a live postgres")
		if os.Geteuid() == 0 {
			// The runuser path: the server must not run as root.
			status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
			require.NoError(t, err)
			assert.NotRegexp(t, `(?m)^Uid:\s+0\s`, string(status), "postmaster runs as root")
		}
	})
	if pid == 0 {
		t.Skip("no server was started") // inner skipped or failed and said why
	}
	assert.False(t, processAlive(pid), "postmaster %d outlived its test", pid)
	assert.NoDirExists(t, dir)
}

// TestPostgresRestart crashes the server with an immediate shutdown and
// expects Restart to recover what was committed, on the same port.
func TestPostgresRestart(t *testing.T) {
	psql := lookPostgresBinary(t, "psql")
	p := StartPostgres(t)
	query := func(sql string) (string, error) {
		out, err := exec.Command(psql, p.DSN, "-XAtc", sql).CombinedOutput()
		return strings.TrimSpace(string(out)), err
	}
	out, err := query("CREATE TABLE t (v text); INSERT INTO t VALUES ('committed')")
	require.NoError(t, err, "%s", out)
	pid, port := postmasterPID(p.Dir), p.Port

	p.Stop(t)
	assert.False(t, processAlive(pid), "postmaster %d outlived Stop", pid)
	_, err = query("SELECT 1")
	assert.Error(t, err, "a query to a stopped server")
	p.Stop(t) // idempotent

	p.Restart(t)
	assert.Equal(t, port, p.Port, "Restart keeps the port")
	out, err = query("SELECT v FROM t")
	require.NoError(t, err, "%s", out)
	assert.Equal(t, "committed", out)
	assert.Contains(t, readLog(p.logPath()), "not properly shut down", "the restart ran crash recovery")

	pid = postmasterPID(p.Dir)
	p.Restart(t)
	assert.False(t, processAlive(pid), "Restart stops a running server first")
	out, err = query("SELECT count(*) FROM t")
	require.NoError(t, err, "%s", out)
	assert.Equal(t, "1", out)
}

func TestMissingBinary(t *testing.T) {
	const name = "testserver-no-such-binary"

	t.Setenv(RequireEnv, "")
	rec := &recorder{TB: t}
	rec.run(func() { lookBinary(rec, name, "install it with magic") })
	assert.Empty(t, rec.fatal)
	assert.Contains(t, rec.skipped, name)
	assert.Contains(t, rec.skipped, "install it with magic")

	t.Setenv(RequireEnv, "1")
	assert.True(t, Require())
	rec = &recorder{TB: t}
	rec.run(func() { lookBinary(rec, name, "install it with magic") })
	assert.Empty(t, rec.skipped)
	assert.Contains(t, rec.fatal, name)
	assert.Contains(t, rec.fatal, "install it with magic")
}

func TestFindBinaryPrefersNewestPostgres(t *testing.T) {
	assert.Positive(t, compareVersions("15", "9.6"))
	assert.Positive(t, compareVersions("10", "9.6"))
	assert.Zero(t, compareVersions("15", "15"))
	assert.Equal(t, "15", pgVersionOf("/usr/lib/postgresql/15/bin/initdb"))
}

func TestFreePortsDistinct(t *testing.T) {
	ports, err := freePorts(20)
	require.NoError(t, err)
	seen := map[int]bool{}
	for _, p := range ports {
		assert.False(t, seen[p], "port %d twice", p)
		seen[p] = true
	}
}

// recorder stands in for a testing.TB to observe Skip and Fatal, which
// unwind with a panic that run recovers, as the real ones unwind the test
// goroutine.
type recorder struct {
	testing.TB
	skipped, fatal string
}

func (r *recorder) Helper() {}

func (r *recorder) Skipf(format string, args ...any) {
	r.skipped = fmt.Sprintf(format, args...)
	panic(r)
}

func (r *recorder) Fatalf(format string, args ...any) {
	r.fatal = fmt.Sprintf(format, args...)
	panic(r)
}

func (r *recorder) run(f func()) {
	defer func() {
		if p := recover(); p != nil && p != any(r) {
			panic(p)
		}
	}()
	f()
}

// IDEMPOTENCY_REDIS_SERVER picks the server, and with it its tool.
func TestRedisServerEnv(t *testing.T) {
	t.Setenv(RedisServerEnv, "")
	assert.Equal(t, "redis-server", RedisServer())
	assert.Equal(t, "redis-cli", redisCLI(RedisServer()))
	t.Setenv(RedisServerEnv, "valkey-server")
	assert.Equal(t, "valkey-server", RedisServer())
	assert.Equal(t, "valkey-cli", redisCLI(RedisServer()))
	assert.Contains(t, redisHint("valkey-cli"), "valkey-server")
	assert.Equal(t, "/opt/valkey/bin/valkey-cli", redisCLI("/opt/valkey/bin/valkey-server"))
	assert.Equal(t, "redis-cli", redisCLI("/usr/local/bin/keydb"))

	t.Setenv(RedisServerEnv, "testserver-no-such-server")
	t.Setenv(RequireEnv, "")
	rec := &recorder{TB: t}
	rec.run(func() { StartRedis(rec) })
	assert.Contains(t, rec.skipped, "testserver-no-such-server", "the server named is the one looked for")
}

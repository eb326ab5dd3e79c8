package idempotency

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-go/idempotency/internal/testkit/testserver"
)

// hasWaitAOF reports whether c's server knows WAITAOF (Redis 7.2 or later,
// Valkey); a test of what it does skips on one that does not, and says how
// to run it.
func hasWaitAOF(t *testing.T, c *redis.Client) bool {
	t.Helper()
	err := c.Do(t.Context(), "WAITAOF", 0, 0, 1).Err()
	if err != nil && !strings.HasPrefix(err.Error(), "ERR unknown command") {
		require.NoError(t, err)
	}
	return err == nil
}

// skipWithoutWaitAOF skips t on a server without WAITAOF.
func skipWithoutWaitAOF(t *testing.T, c *redis.Client) {
	t.Helper()
	if !hasWaitAOF(t, c) {
		t.Skipf("%s has no WAITAOF: run with %s=valkey-server", testserver.RedisServer(), testserver.RedisServerEnv)
	}
}

// counted is an operation that counts its runs.
type counted struct{ runs atomic.Int32 }

func (c *counted) charge(context.Context) (Response, error) {
	c.runs.Add(1)
	return Response{Status: 201, Body: []byte("charged")}, nil
}

// TestRedisFsync runs a store with Fsync on a server with WAITAOF and
// appendonly yes, appendfsync always (everysec is refused: see
// TestRedisFsyncEverysec): what decides an operation waits for the
// master's fsync in the same round trip, the scripts of a batch share one
// WAITAOF, and a write the disk does not confirm in time fails closed, its
// operation not run.
func TestRedisFsync(t *testing.T) {
	srv := testserver.StartRedis(t, "--appendonly", "yes", "--appendfsync", "always")
	admin := srv.Client()
	skipWithoutWaitAOF(t, admin)
	ctx := t.Context()
	s := newRedisStoreWith(t, srv.Client(), RedisOptions{Fsync: Fsync{Master: true}})
	g := New(s, Options{})
	fp := FingerprintOf("charge", nil)
	var op counted

	t.Run("Counted", func(t *testing.T) {
		_, err := g.Do(ctx, Key{Name: "first"}, fp, op.charge) // loads the scripts
		require.NoError(t, err)
		// A store's first call to a master asks it first, once, writing
		// nothing: whether it can wait for its append-only file (a WAITAOF,
		// and a CONFIG GET, which MONITOR does not show).
		fresh := New(newRedisStoreWith(t, srv.Client(), RedisOptions{Fsync: Fsync{Master: true}}), Options{})
		assert.Equal(t, map[string]int{"waitaof": 3, "evalsha": 2}, countCommands(t, srv.Addr, func() {
			_, err := fresh.Do(ctx, Key{Name: "fresh"}, fp, op.charge)
			require.NoError(t, err)
		}), "the probe, then the claim and the completion, each with its WAITAOF")
		k := Key{Name: "counted"}
		assert.Equal(t, map[string]int{"evalsha": 2, "waitaof": 2}, countCommands(t, srv.Addr, func() {
			_, err := g.Do(ctx, k, fp, op.charge)
			require.NoError(t, err)
		}), "new operation: claim and completion, each followed by one WAITAOF")
		assert.Equal(t, map[string]int{"evalsha": 1, "waitaof": 1}, countCommands(t, srv.Addr, func() {
			r, err := g.Do(ctx, k, fp, op.charge)
			require.NoError(t, err)
			require.True(t, r.Replayed)
		}), "replay: one round trip, whose WAITAOF has nothing to wait for")
		assert.Equal(t, int32(3), op.runs.Load())
	})

	t.Run("Batched", func(t *testing.T) {
		c := srv.Client()
		batchedCalls(t, c, RedisOptions{Fsync: Fsync{Master: true}},
			func(ctx context.Context) error { return c.ScriptFlush(ctx).Err() })
	})

	// WAITAOF's reply is checked: the master fsynced, but no replica did,
	// for there is none.
	t.Run("TooFewReplicas", func(t *testing.T) {
		replicas := newRedisStoreWith(t, srv.Client(), RedisOptions{Fsync: Fsync{Master: true, Replicas: 1, Timeout: 200 * time.Millisecond}})
		k := Key{Name: "too-few-replicas"}
		before := op.runs.Load()
		_, err := New(replicas, Options{}).Do(ctx, k, fp, op.charge)
		require.ErrorIs(t, err, ErrUnavailable)
		assert.ErrorContains(t, err, "fsynced on 1 of 1 masters and 0 of 1 replicas within 200ms")
		assert.Equal(t, before, op.runs.Load(), "the operation ran")
		c := ownFor(t, newRedisStore(t, srv.Client()), k, fp)
		assert.Equal(t, 1, c.Attempt, "the claim's record was deleted")
	})

	// appendfsync no once the store has asked: the master never fsyncs on
	// its own, so every wait times out, and nothing runs.
	t.Run("TimeOut", func(t *testing.T) {
		short := newRedisStoreWith(t, srv.Client(), RedisOptions{Fsync: Fsync{Master: true, Timeout: 300 * time.Millisecond}})
		short.fsyncSchedule.recheck = time.Hour // the waits time out, rather than a new probe refuse appendfsync no
		gs := New(short, Options{})
		_, err := gs.Do(ctx, Key{Name: "probed"}, fp, op.charge)
		require.NoError(t, err)
		require.NoError(t, admin.ConfigSet(ctx, "appendfsync", "no").Err())
		t.Cleanup(func() { admin.ConfigSet(context.Background(), "appendfsync", "always") })
		before := op.runs.Load()
		for _, name := range []string{"timed-out-1", "timed-out-2", "timed-out-3"} {
			_, err := gs.Do(ctx, Key{Name: name}, fp, op.charge)
			require.ErrorIs(t, err, ErrUnavailable)
			assert.ErrorContains(t, err, "fsynced on 0 of 1 masters")
		}
		assert.Equal(t, before, op.runs.Load(), "an operation ran")

		// A completion that times out is not reported done, though the
		// master keeps it, and its retry replays it.
		require.NoError(t, admin.ConfigSet(ctx, "appendfsync", "always").Err())
		k := Key{Name: "unconfirmed-completion"}
		_, err = gs.Do(ctx, k, fp, func(ctx context.Context) (Response, error) {
			require.NoError(t, admin.ConfigSet(ctx, "appendfsync", "no").Err())
			return op.charge(ctx)
		})
		require.ErrorIs(t, err, ErrUnavailable)
		require.NoError(t, admin.ConfigSet(ctx, "appendfsync", "always").Err())
		r, err := gs.Do(ctx, k, fp, op.charge)
		require.NoError(t, err)
		assert.True(t, r.Replayed)
		assert.Equal(t, before+1, op.runs.Load())
	})
}

// A master that cannot wait for its append-only file is refused by the
// first call to it, before anything is written, and by CheckPersistence;
// the calls after it, within the back-off, fail at once, sending nothing
// (the store here backs off for an hour; TestRedisFsyncRecovers has it ask
// again). Neither error is ErrUnavailable (Options.FailOpen would run
// operations unguarded on it), nor ErrNoPersistence, which a service may
// accept.
func TestRedisFsyncRefused(t *testing.T) {
	for _, tc := range []struct {
		name string
		args []string
		why  string // on a server with WAITAOF
	}{
		{"appendonly no", nil, "has appendonly no"},
		{"appendfsync no", []string{"--appendonly", "yes", "--appendfsync", "no"}, "has appendfsync no"},
		{"appendfsync everysec", []string{"--appendonly", "yes", "--appendfsync", "everysec"}, "has appendfsync everysec, where WAITAOF may answer before the fsync"},
		{"appendfsync always", []string{"--appendonly", "yes", "--appendfsync", "always"}, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := t.Context()
			srv := testserver.StartRedis(t, tc.args...)
			admin := srv.Client()
			why := tc.why
			if !hasWaitAOF(t, admin) {
				why = "has no WAITAOF, which needs Redis 7.2 or later"
			}
			if why == "" {
				t.Skip("a server that can: see TestRedisFsync")
			}
			s := newRedisStoreWith(t, srv.Client(), RedisOptions{Fsync: Fsync{Master: true}})
			s.fsyncSchedule.first = time.Hour
			g := New(s, Options{})
			var op counted
			_, err := g.Do(ctx, Key{Name: "k"}, FingerprintOf("op", nil), op.charge)
			require.ErrorIs(t, err, errCannotFsync)
			assert.ErrorContains(t, err, srv.Addr+" "+why)
			assert.NotErrorIs(t, err, ErrUnavailable)
			assert.Zero(t, op.runs.Load(), "the operation ran")
			assert.Zero(t, admin.DBSize(ctx).Val(), "something was written")

			assert.Empty(t, countCommands(t, srv.Addr, func() {
				_, err := g.Do(ctx, Key{Name: "k2"}, FingerprintOf("op", nil), op.charge)
				assert.ErrorIs(t, err, errCannotFsync)
				// Not a store that cannot be reached: FailOpen does not run
				// the handler unguarded.
				ran := false
				h := g.Middleware(MiddlewareOptions{Scope: SingleTenant, FailOpen: true})(
					http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { ran = true }))
				rr := httptest.NewRecorder()
				h.ServeHTTP(rr, keyed("k3", "{}"))
				assert.False(t, ran, "FailOpen ran the handler")
				assert.Equal(t, http.StatusServiceUnavailable, rr.Code)
			}), "a call within the back-off sends nothing")
			assert.Zero(t, op.runs.Load())

			_, err = newRedisStoreWith(t, srv.Client(), RedisOptions{Fsync: Fsync{Master: true}}).CheckPersistence(ctx)
			require.ErrorIs(t, err, errCannotFsync)
			assert.ErrorContains(t, err, srv.Addr+" "+why)
			assert.NotErrorIs(t, err, ErrNoPersistence, "a refusal a service cannot accept")
			assert.NotErrorIs(t, err, ErrUnavailable)
		})
	}
}

// Fsync cannot be asked with waits that the client would time out, nor a
// negative count. Nothing here connects.
func TestRedisFsyncMisconfigured(t *testing.T) {
	c := redis.NewClient(&redis.Options{ReadTimeout: time.Second})
	defer c.Close()
	_, err := NewRedisStore(c, RedisOptions{Fsync: Fsync{Master: true}})
	assert.ErrorContains(t, err, "RedisOptions.Fsync.Timeout 1s is not below the client's ReadTimeout 1s", "default Fsync.Timeout, 1s")
	_, err = NewRedisStore(c, RedisOptions{Replicas: 1, ReplicaTimeout: 500 * time.Millisecond, Fsync: Fsync{Replicas: 1, Timeout: 500 * time.Millisecond}})
	assert.ErrorContains(t, err, "RedisOptions.ReplicaTimeout 500ms plus Fsync.Timeout 500ms is not below the client's ReadTimeout 1s")
	_, err = NewRedisStore(c, RedisOptions{Fsync: Fsync{Replicas: -1}})
	assert.ErrorContains(t, err, "want 0 or more")
	s, err := NewRedisStore(c, RedisOptions{Fsync: Fsync{Master: true, Timeout: 900 * time.Millisecond}})
	require.NoError(t, err)
	s.Close()
}

// CheckPersistence's answers, each from a real server configured so:
// nothing (refused, unless the service accepts ErrNoPersistence), a process
// crash, a power loss; and with Fsync.Master, a master that cannot wait
// (everysec, or a server without WAITAOF) refused with errCannotFsync.
func TestRedisCheckPersistence(t *testing.T) {
	ctx := t.Context()
	everysec := "appendonly yes, appendfsync everysec (a power loss can lose about the last second"
	for _, tc := range []struct {
		args     []string
		fsync    Fsync
		survives Survival
		why      string
		refused  string // with fsync, on a server with WAITAOF
	}{
		{nil, Fsync{}, SurvivesNothing, "appendonly no", ""},
		{[]string{"--appendonly", "yes", "--appendfsync", "no"}, Fsync{}, SurvivesProcessCrash, "appendonly yes, appendfsync no", ""},
		{[]string{"--appendonly", "yes", "--appendfsync", "everysec"}, Fsync{}, SurvivesProcessCrash, everysec + ")", ""},
		{[]string{"--appendonly", "yes", "--appendfsync", "always"}, Fsync{}, SurvivesPowerLoss, "appendonly yes, appendfsync always", ""},
		{[]string{"--appendonly", "yes", "--appendfsync", "always"}, Fsync{Master: true}, SurvivesPowerLoss, "appendonly yes, appendfsync always", ""},
		{[]string{"--appendonly", "yes", "--appendfsync", "everysec"}, Fsync{Master: true}, SurvivesProcessCrash,
			everysec + "; RedisOptions.Fsync.Master needs appendfsync always)", "has appendfsync everysec"},
	} {
		name := tc.why
		if tc.fsync.Master {
			name = "Fsync.Master, " + name
		}
		t.Run(name, func(t *testing.T) {
			srv := testserver.StartRedis(t, tc.args...)
			refused := tc.refused
			if tc.fsync.on() && !hasWaitAOF(t, srv.Client()) {
				refused = "has no WAITAOF"
			}
			p, err := newRedisStoreWith(t, srv.Client(), RedisOptions{Fsync: tc.fsync}).CheckPersistence(ctx)
			assert.Equal(t, Persistence{Survives: tc.survives, Reason: srv.Addr + ": " + tc.why}, p)
			switch {
			case refused != "":
				require.ErrorIs(t, err, errCannotFsync)
				assert.ErrorContains(t, err, srv.Addr+" "+refused)
				assert.NotErrorIs(t, err, ErrUnavailable)
				return
			case tc.survives != SurvivesNothing:
				assert.NoError(t, err)
				return
			}
			require.ErrorIs(t, err, ErrNoPersistence)
			assert.NotErrorIs(t, err, ErrUnavailable)
			assert.ErrorContains(t, err, srv.Addr+": appendonly no")
			assert.Equal(t, "a restart keeps nothing ("+srv.Addr+": appendonly no)", p.String())
		})
	}

	// Why it matters: the server without persistence forgets a completed
	// operation when it restarts, and the retry runs it again.
	srv := testserver.StartRedis(t)
	g := New(newRedisStore(t, srv.Client()), Options{})
	var op counted
	k, fp := Key{Name: "charge"}, FingerprintOf("op", nil)
	_, err := g.Do(ctx, k, fp, op.charge)
	require.NoError(t, err)
	srv.Restart(t)
	require.Eventually(t, func() bool {
		_, err = g.Do(ctx, k, fp, op.charge)
		return err == nil
	}, 20*time.Second, 50*time.Millisecond)
	assert.Equal(t, int32(2), op.runs.Load(), "the retry after the restart ran the operation again")
}

// A server that will not say (CONFIG or INFO denied, as managed services
// do, or miniredis) is "cannot tell", with the reason, and no error; one
// that cannot be reached is ErrUnavailable.
func TestRedisCheckPersistenceUnknown(t *testing.T) {
	ctx := t.Context()
	srv := testserver.StartRedis(t, "--appendonly", "yes")
	admin := srv.Client()
	for _, tc := range []struct {
		user, deny, why string
	}{
		{"noconfig", "-config", "appendonly yes, but cannot tell its appendfsync: CONFIG GET refused: NOPERM"},
		{"noinfo", "-info", "cannot tell: INFO refused: NOPERM"},
	} {
		require.NoError(t, admin.Do(ctx, "ACL", "SETUSER", tc.user, "on", ">pw", "~*", "&*", "+@all", tc.deny).Err())
		app := redis.NewClient(&redis.Options{Addr: srv.Addr, Username: tc.user, Password: "pw"})
		t.Cleanup(func() { app.Close() })
		p, err := newRedisStore(t, app).CheckPersistence(ctx)
		require.NoError(t, err, tc.user)
		assert.Equal(t, SurvivalUnknown, p.Survives, tc.user)
		assert.True(t, strings.HasPrefix(p.Reason, srv.Addr+": "+tc.why), "%s: %s", tc.user, p.Reason)
	}

	mini := redis.NewClient(&redis.Options{Addr: miniredis.RunT(t).Addr()})
	t.Cleanup(func() { mini.Close() })
	p, err := newRedisStore(t, mini).CheckPersistence(ctx)
	require.NoError(t, err)
	assert.Equal(t, SurvivalUnknown, p.Survives, p.Reason)

	s := newRedisStore(t, admin)
	srv.Stop(t)
	_, err = s.CheckPersistence(ctx)
	assert.ErrorIs(t, err, ErrUnavailable)
}

// clusterCheckPersistence: CheckPersistence asks every node, replicas too,
// and names each one that keeps nothing.
func clusterCheckPersistence(t *testing.T, cl *testserver.Cluster) {
	p, err := newRedisStore(t, cl.Client()).CheckPersistence(t.Context())
	require.ErrorIs(t, err, ErrNoPersistence)
	assert.Equal(t, SurvivesNothing, p.Survives)
	for _, addr := range cl.Addrs {
		assert.ErrorContains(t, err, addr+": appendonly no")
	}
}

// clusterFsync: with appendonly yes on every node, a store asking each
// master and one of its replicas for the fsync serves on every master;
// without WAITAOF, the cluster is refused. (appendfsync always: a replica
// with everysec confirms up to a second later, its next fsync.)
func clusterFsync(t *testing.T, cl *testserver.Cluster) {
	ctx := t.Context()
	cc := cl.Client()
	require.NoError(t, cc.ForEachShard(ctx, func(ctx context.Context, c *redis.Client) error {
		return c.Do(ctx, "CONFIG", "SET", "appendonly", "yes", "appendfsync", "always").Err()
	}))
	t.Cleanup(func() {
		cc.ForEachShard(context.Background(), func(ctx context.Context, c *redis.Client) error {
			return c.Do(ctx, "CONFIG", "SET", "appendonly", "no", "appendfsync", "everysec").Err()
		})
	})
	o := RedisOptions{Prefix: "fsync:", Fsync: Fsync{Master: true, Replicas: 1, Timeout: 2 * time.Second}}
	s := newRedisStoreWith(t, cc, o)
	g := New(s, Options{})
	var op counted
	fp := FingerprintOf("op", nil)
	if !hasWaitAOF(t, cl.Nodes[0].Client()) {
		_, err := g.Do(ctx, Key{Name: "k"}, fp, op.charge)
		require.ErrorIs(t, err, errCannotFsync)
		assert.Zero(t, op.runs.Load())
		return
	}
	// An AOF rewrite starts when appendonly is turned on; until it ends,
	// WAITAOF confirms nothing.
	require.Eventually(t, func() bool {
		_, err := g.Do(ctx, Key{Name: "ready"}, fp, op.charge)
		return err == nil
	}, 20*time.Second, 100*time.Millisecond)
	p, err := s.CheckPersistence(ctx)
	require.NoError(t, err)
	assert.Equal(t, SurvivesPowerLoss, p.Survives, p.Reason)
	// A key on each master. A replica reports its fsyncs about once a
	// second, so each wait takes up to that.
	masters := map[string]bool{}
	for i := 0; len(masters) < 3; i++ {
		require.Less(t, i, 100, "no key found on every master")
		k := Key{Scope: "fsync", Name: fmt.Sprint("k", i)}
		rec, _ := s.recordKey(k)
		if m := cl.MasterFor(rec).Addr; !masters[m] {
			masters[m] = true
			before := op.runs.Load()
			r, err := g.Do(ctx, k, fp, op.charge)
			require.NoError(t, err)
			assert.False(t, r.Replayed)
			assert.Equal(t, before+1, op.runs.Load())
		}
	}
}

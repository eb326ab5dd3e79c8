package idempotency

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-go/idempotency/internal/testkit/faultproxy"
	"github.com/idempotency-go/idempotency/internal/testkit/testserver"
)

// redisBackends runs f on miniredis and on a throwaway real redis-server.
func redisBackends(t *testing.T, f func(t *testing.T, c *redis.Client)) {
	t.Run("miniredis", func(t *testing.T) {
		c := redis.NewClient(&redis.Options{Addr: miniredis.RunT(t).Addr()})
		t.Cleanup(func() { c.Close() })
		f(t, c)
	})
	t.Run("redis-server", func(t *testing.T) {
		f(t, testserver.StartRedis(t).Client())
	})
}

func newRedisStore(t *testing.T, c redis.UniversalClient) *RedisStore {
	return newRedisStoreWith(t, c, RedisOptions{})
}

// newRedisStoreWith is newRedisStore configured by o.
func newRedisStoreWith(t *testing.T, c redis.UniversalClient, o RedisOptions) *RedisStore {
	s, err := NewRedisStore(c, o)
	require.NoError(t, err)
	t.Cleanup(func() { s.Close() })
	return s
}

// The client's type decides how waiters are woken: a ClusterClient gets
// sharded pub/sub, and a Sentinel failover client, a *redis.Client, plain
// pub/sub on its one master. It also decides whether the store's calls end
// by their deadlines: a *redis.Client's with ContextTimeoutEnabled do, a
// ClusterClient's may not (see NewRedisStore). Nothing here connects.
func TestRedisStoreMode(t *testing.T) {
	for _, tc := range []struct {
		name    string
		opts    redis.UniversalOptions
		publish string
		bound   bool // with ContextTimeoutEnabled
	}{
		{"standalone", redis.UniversalOptions{Addrs: []string{"127.0.0.1:1"}}, "PUBLISH", true},
		{"sentinel", redis.UniversalOptions{Addrs: []string{"127.0.0.1:1"}, MasterName: "primary"}, "PUBLISH", true},
		{"cluster", redis.UniversalOptions{Addrs: []string{"127.0.0.1:1", "127.0.0.1:2"}}, "SPUBLISH", false},
	} {
		for _, honours := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/ContextTimeoutEnabled=%v", tc.name, honours), func(t *testing.T) {
				tc.opts.ContextTimeoutEnabled = honours
				c := redis.NewUniversalClient(&tc.opts)
				defer c.Close()
				s, err := NewRedisStore(c, RedisOptions{Replicas: 1, ReplicaTimeout: time.Millisecond})
				require.NoError(t, err)
				defer s.Close()
				assert.Equal(t, tc.publish, s.publish)
				assert.Equal(t, honours && tc.bound, s.endsByDeadline)
			})
		}
	}
}

// Other clients are refused: a Ring spreads a record's keys and channel by
// its own rules, and a wrapper hides the client the store needs to find the
// server of a record. Nothing here connects.
func TestRedisStoreRefusesOtherClients(t *testing.T) {
	ring := redis.NewRing(&redis.RingOptions{Addrs: map[string]string{"a": "127.0.0.1:1"}})
	defer ring.Close()
	_, err := NewRedisStore(ring, RedisOptions{})
	assert.ErrorContains(t, err, "needs a *redis.Client or a *redis.ClusterClient, not *redis.Ring")

	c := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"})
	defer c.Close()
	_, err = NewRedisStore(wrappedClient{c}, RedisOptions{})
	assert.ErrorContains(t, err, "not idempotency.wrappedClient")
}

type wrappedClient struct{ redis.UniversalClient }

// A waiter must be woken by the completion's publish, not by its re-check
// timer: with an hour-long re-check, only pub/sub can end the wait.
func TestRedisWakeUpIsPublished(t *testing.T) {
	redisBackends(t, func(t *testing.T, c *redis.Client) {
		s := newRedisStore(t, c)
		g := New(s, Options{RecheckInterval: time.Hour, WaitTimeout: 30 * time.Second})
		k, fp := Key{Name: "wake"}, FingerprintOf("op", nil)
		started, finish := make(chan struct{}), make(chan struct{})
		var owner sync.WaitGroup
		defer owner.Wait()
		owner.Go(func() {
			_, err := g.Do(context.Background(), k, fp, func(context.Context) (Response, error) {
				close(started)
				<-finish
				return Response{Status: 201, Body: []byte("done")}, nil
			})
			assert.NoError(t, err)
		})
		<-started
		got := make(chan Result, 1)
		go func() {
			r, err := g.Do(context.Background(), k, fp, func(context.Context) (Response, error) {
				t.Error("the duplicate ran the operation")
				return Response{}, nil
			})
			assert.NoError(t, err)
			got <- r
		}()
		waitForWatcher(t, c, s, k)
		close(finish)
		select {
		case r := <-got:
			assert.True(t, r.Replayed)
			assert.Equal(t, "done", string(r.Response.Body))
		case <-time.After(20 * time.Second):
			t.Fatal("the waiter was not woken by the completion")
		}
	})
}

// waitForWatcher returns once a waiter has registered on k's record, so the
// completion that follows has someone to publish to.
func waitForWatcher(t *testing.T, c redis.UniversalClient, s *RedisStore, k Key) {
	t.Helper()
	rec, _ := s.recordKey(k)
	require.Eventually(t, func() bool {
		// In flight: "<deadline> <token> <attempt> <x><w> <by>" after the
		// operation ID (see lua/record.lua).
		v := c.Get(context.Background(), rec).Val()
		if len(v) < 34 || v[0] != 'p' || len(v) < 34+int(v[33]) {
			return false
		}
		f := strings.SplitN(v[34+int(v[33]):], " ", 5)
		return len(f) == 5 && f[3] == f[3][:1]+"1"
	}, 10*time.Second, time.Millisecond)
}

// Completions racing the waiters' subscriptions, many times over: with the
// re-check timer out of the way, a lost wake-up shows as ErrInFlight.
func TestRedisNoLostWakeUp(t *testing.T) {
	redisBackends(t, func(t *testing.T, c *redis.Client) {
		noLostWakeUp(t, newRedisStore(t, c))
	})
}

func noLostWakeUp(t *testing.T, s *RedisStore) {
	g := New(s, Options{RecheckInterval: time.Hour, WaitTimeout: 5 * time.Second})
	const keys = 300
	var lost atomic.Int32
	var wg sync.WaitGroup
	for i := range keys {
		k, fp := Key{Name: fmt.Sprintf("race-%d", i)}, FingerprintOf("op", nil)
		claim, err := s.Claim(context.Background(), ClaimRequest{Key: k, Fingerprint: fp, OperationID: "op", Lease: time.Minute, Retention: time.Hour})
		require.NoError(t, err)
		require.Equal(t, Owner, claim.State)
		wg.Add(2)
		go func() {
			defer wg.Done()
			r, err := g.Do(context.Background(), k, fp, func(context.Context) (Response, error) {
				return Response{}, errors.New("the duplicate ran the operation")
			})
			if errors.Is(err, ErrInFlight) {
				lost.Add(1)
				return
			}
			assert.NoError(t, err)
			assert.Equal(t, strconv.Itoa(i), string(r.Response.Body))
		}()
		go func() {
			defer wg.Done()
			time.Sleep(time.Duration(rand.IntN(3000)) * time.Microsecond)
			assert.NoError(t, s.Complete(context.Background(), k, claim.Token, Response{Status: 200, Body: []byte(strconv.Itoa(i))}, time.Hour))
		}()
	}
	wg.Wait()
	assert.Zero(t, lost.Load(), "waiters never woken")
}

// A waiter whose pub/sub connection drops is subscribed again on a new one
// and woken to re-read: the completion that follows reaches it, though only
// pub/sub can wake it.
func TestRedisWaiterSurvivesDroppedConnection(t *testing.T) {
	srv := testserver.StartRedis(t)
	c := srv.Client()
	s := newRedisStore(t, c)
	g := New(s, Options{RecheckInterval: time.Hour, WaitTimeout: 30 * time.Second})
	ctx := context.Background()
	k, fp := Key{Name: "dropped"}, FingerprintOf("op", nil)
	claim := ownFor(t, s, k, fp)
	got := make(chan Result, 1)
	go func() {
		r, err := g.Do(ctx, k, fp, func(context.Context) (Response, error) {
			return Response{}, errors.New("the duplicate ran the operation")
		})
		assert.NoError(t, err)
		got <- r
	}()
	waitForWatcher(t, c, s, k)
	rec, _ := s.recordKey(k)
	subscribers := func() int64 { return c.PubSubNumSub(ctx, rec).Val()[rec] }
	require.Equal(t, int64(1), subscribers())
	require.NoError(t, c.ClientKillByFilter(ctx, "TYPE", "pubsub").Err())
	require.Eventually(t, func() bool { return subscribers() == 1 }, 10*time.Second, 10*time.Millisecond,
		"the waiter was not subscribed again")
	require.NoError(t, s.Complete(ctx, k, claim.Token, Response{Status: 201, Body: []byte("done")}, time.Hour))
	select {
	case r := <-got:
		assert.True(t, r.Replayed)
		assert.Equal(t, "done", string(r.Response.Body))
	case <-time.After(20 * time.Second):
		t.Fatal("the waiter was not woken after its connection dropped")
	}
}

// ownFor claims k as its new owner.
func ownFor(t *testing.T, s *RedisStore, k Key, fp Fingerprint) Claim {
	c, err := s.Claim(context.Background(), ClaimRequest{Key: k, Fingerprint: fp, OperationID: "op", Lease: time.Minute, Retention: time.Hour})
	require.NoError(t, err)
	require.Equal(t, Owner, c.State)
	return c
}

// Redis formats Lua numbers with %.14g; tokens past 1e14 must still cross
// the boundary exactly.
func TestRedisLargeTokens(t *testing.T) {
	redisBackends(t, func(t *testing.T, c *redis.Client) {
		s := newRedisStore(t, c)
		k := Key{Name: "big"}
		_, bk := s.recordKey(k)
		seq := bk.seq.(string)
		const start = 1_234_567_890_123_456
		require.NoError(t, c.Set(context.Background(), seq, start, 0).Err())
		claim, err := s.Claim(context.Background(), ClaimRequest{Key: k, OperationID: "op", Lease: time.Minute, Retention: time.Hour})
		require.NoError(t, err)
		assert.Equal(t, uint64(start+1), claim.Token)
		assert.NoError(t, s.Heartbeat(context.Background(), k, claim.Token, time.Minute))
		assert.ErrorIs(t, s.Heartbeat(context.Background(), k, claim.Token+1, time.Minute), ErrFenced)
		assert.NoError(t, s.Complete(context.Background(), k, claim.Token, Response{Status: 200}, time.Hour))
	})
}

// Round trips, counted by the server: a new operation costs two scripts, a
// replay one, and a waited request a bounded number however long it waits.
func TestRedisRoundTrips(t *testing.T) {
	srv := testserver.StartRedis(t)
	s := newRedisStore(t, srv.Client())
	g := New(s, Options{RecheckInterval: time.Hour})
	ctx := context.Background()
	fp := FingerprintOf("op", nil)
	ok := func(context.Context) (Response, error) { return Response{Status: 200}, nil }
	_, err := g.Do(ctx, Key{Name: "warm"}, fp, ok) // loads the scripts
	require.NoError(t, err)

	assert.Equal(t, map[string]int{"evalsha": 2}, countCommands(t, srv.Addr, func() {
		_, err := g.Do(ctx, Key{Name: "new"}, fp, ok)
		require.NoError(t, err)
	}), "new operation")
	assert.Equal(t, map[string]int{"evalsha": 1}, countCommands(t, srv.Addr, func() {
		r, err := g.Do(ctx, Key{Name: "new"}, fp, ok)
		require.NoError(t, err)
		require.True(t, r.Replayed)
	}), "replay")

	k := Key{Name: "waited"}
	claim, err := s.Claim(ctx, ClaimRequest{Key: k, Fingerprint: fp, OperationID: "op", Lease: time.Minute, Retention: time.Hour})
	require.NoError(t, err)
	poll := srv.Client()
	waited := countCommands(t, srv.Addr, func() {
		done := make(chan struct{})
		go func() {
			defer close(done)
			r, err := g.Do(ctx, k, fp, ok)
			assert.NoError(t, err)
			assert.True(t, r.Replayed)
		}()
		waitForWatcher(t, poll, s, k)
		time.Sleep(300 * time.Millisecond) // however long it waits, it sends nothing more
		require.NoError(t, s.Complete(ctx, k, claim.Token, Response{Status: 200}, time.Hour))
		<-done
	})
	delete(waited, "get") // the test's own polling
	// The waiter: claim, subscribe, watching claim, claim after the wake-up,
	// unsubscribe as it leaves. The fourth script is the owner's completion.
	assert.Equal(t, map[string]int{"evalsha": 4, "subscribe": 1, "unsubscribe": 1}, waited, "waited request")
}

// countCommands counts, through MONITOR, the commands clients send while f
// runs: not those that scripts run, nor connection handshakes and health
// checks.
func countCommands(t *testing.T, addr string, f func()) map[string]int {
	conn, err := net.Dial("tcp", addr)
	require.NoError(t, err)
	defer conn.Close()
	r := bufio.NewReader(conn)
	_, err = conn.Write([]byte("MONITOR\r\n"))
	require.NoError(t, err)
	ok, err := r.ReadString('\n')
	require.NoError(t, err)
	require.Equal(t, "+OK\r\n", ok)

	f()
	marker := fmt.Sprintf("end-of-count-%d", rand.Uint64())
	echo := redis.NewClient(&redis.Options{Addr: addr})
	defer echo.Close()
	require.NoError(t, echo.Echo(context.Background(), marker).Err())
	require.NoError(t, conn.SetReadDeadline(time.Now().Add(10*time.Second)))
	counts := map[string]int{}
	for {
		line, err := r.ReadString('\n')
		require.NoError(t, err)
		if strings.Contains(line, marker) {
			return counts
		}
		_, cmd, ok := strings.Cut(line, "] \"")
		if !ok || strings.Contains(line, " lua] ") {
			continue
		}
		switch name := strings.ToLower(cmd[:strings.IndexByte(cmd, '"')]); name {
		case "hello", "client", "ping":
		default:
			counts[name]++
		}
	}
}

// With Redis down nothing runs and Do reports ErrUnavailable; once Redis is
// back the same key works.
func TestRedisOutage(t *testing.T) {
	srv := testserver.StartRedis(t)
	s := newRedisStore(t, srv.Client())
	g := New(s, Options{})
	ctx := context.Background()
	var runs atomic.Int32
	fn := func(context.Context) (Response, error) { runs.Add(1); return Response{Status: 201}, nil }

	srv.Stop(t)
	_, err := g.Do(ctx, Key{Name: "outage"}, FingerprintOf("op", nil), fn)
	require.ErrorIs(t, err, ErrUnavailable)
	assert.Zero(t, runs.Load())

	srv.Restart(t)
	require.Eventually(t, func() bool {
		_, err := g.Do(ctx, Key{Name: "outage"}, FingerprintOf("op", nil), fn)
		return err == nil
	}, 10*time.Second, 50*time.Millisecond)
	assert.Equal(t, int32(1), runs.Load())
}

// go-redis sends a script again after a network error, so a claim whose
// reply was lost runs twice: the second run must answer as the first did,
// not report the caller's own claim as someone else's in flight.
func TestRedisClaimRunTwice(t *testing.T) {
	redisBackends(t, func(t *testing.T, c *redis.Client) {
		s := newRedisStore(t, c)
		ctx := context.Background()
		k, fp := Key{Name: "twice"}, FingerprintOf("op", nil)
		req := ClaimRequest{Key: k, Fingerprint: fp, OperationID: "op_first", Lease: time.Minute, Retention: time.Hour}
		first, err := s.Claim(ctx, req)
		require.NoError(t, err)
		again, err := s.Claim(ctx, req)
		require.NoError(t, err)
		assert.Equal(t, first, again)

		other := req
		other.OperationID = "op_other"
		busy, err := s.Claim(ctx, other)
		require.NoError(t, err)
		assert.Equal(t, InFlight, busy.State, "another claim still finds the record in flight")

		require.NoError(t, s.Release(ctx, k, first.Token))
		taker := req
		taker.OperationID = "op_taker"
		took, err := s.Claim(ctx, taker)
		require.NoError(t, err)
		require.Equal(t, Owner, took.State)
		again, err = s.Claim(ctx, taker)
		require.NoError(t, err)
		assert.Equal(t, took, again, "a takeover run twice")
		assert.Equal(t, "op_first", again.OperationID)
		assert.Equal(t, 2, again.Attempt)
	})
}

// A completion run twice (go-redis resends a script whose reply was lost)
// finds its own response stored and succeeds; another outcome is fenced. A
// release or forget run twice is fenced the second time, as the Store
// contract allows: the caller owns nothing any more.
func TestRedisSettleRunTwice(t *testing.T) {
	redisBackends(t, func(t *testing.T, c *redis.Client) {
		s := newRedisStore(t, c)
		ctx := context.Background()
		fp := FingerprintOf("op", nil)
		claim := func(name string) Claim {
			c, err := s.Claim(ctx, ClaimRequest{Key: Key{Name: name}, Fingerprint: fp, OperationID: "op_" + name, Lease: time.Minute, Retention: time.Hour})
			require.NoError(t, err)
			require.Equal(t, Owner, c.State)
			return c
		}
		resp := Response{Status: 201, Body: []byte("charged")}

		c1 := claim("complete")
		require.NoError(t, s.Complete(ctx, Key{Name: "complete"}, c1.Token, resp, time.Hour))
		require.NoError(t, s.Complete(ctx, Key{Name: "complete"}, c1.Token, resp, time.Hour), "the same completion again")
		require.ErrorIs(t, s.Complete(ctx, Key{Name: "complete"}, c1.Token, Response{Status: 201, Body: []byte("other")}, time.Hour),
			ErrFenced, "another outcome for a settled record")
		replay, err := s.Claim(ctx, ClaimRequest{Key: Key{Name: "complete"}, Fingerprint: fp, OperationID: "op_next", Lease: time.Minute, Retention: time.Hour})
		require.NoError(t, err)
		assert.Equal(t, "charged", string(replay.Response.Body))

		c2 := claim("release")
		require.NoError(t, s.Release(ctx, Key{Name: "release"}, c2.Token))
		require.ErrorIs(t, s.Release(ctx, Key{Name: "release"}, c2.Token), ErrFenced, "a release again")
		taker := claim("release")
		assert.Equal(t, 2, taker.Attempt, "released once")

		c3 := claim("forget")
		require.NoError(t, s.Forget(ctx, Key{Name: "forget"}, c3.Token))
		require.ErrorIs(t, s.Forget(ctx, Key{Name: "forget"}, c3.Token), ErrFenced, "a forget again")
	})
}

// A settling call whose reply is lost after redis-server applied it is
// resent by go-redis. A completion's resend finds its own outcome stored and
// succeeds, where it used to answer ErrFenced for the outcome it had stored
// (found by idempotencytest/linearizable under link faults). A release's or
// forget's resend is fenced, as the Store contract allows, and the change
// stands.
func TestRedisLostSettleReply(t *testing.T) {
	srv := testserver.StartRedis(t)
	p := faultproxy.Start(t, srv.Addr)
	c := redis.NewClient(&redis.Options{Addr: p.Addr()})
	t.Cleanup(func() { c.Close() })
	s := newRedisStore(t, c)
	ctx := context.Background()
	fp := FingerprintOf("op", nil)
	for _, settle := range []string{"complete", "release", "forget"} {
		// The scripts are loaded first: the reply lost must be the
		// script's, not a NOSCRIPT answer to be followed by its source.
		warm := Key{Name: "warm-" + settle}
		w, err := s.Claim(ctx, ClaimRequest{Key: warm, Fingerprint: fp, OperationID: "op", Lease: time.Minute, Retention: time.Hour})
		require.NoError(t, err)
		require.NoError(t, s.Complete(ctx, warm, w.Token, Response{Status: 201}, time.Hour))
		w, err = s.Claim(ctx, ClaimRequest{Key: Key{Name: "warm2-" + settle}, Fingerprint: fp, OperationID: "op", Lease: time.Minute, Retention: time.Hour})
		require.NoError(t, err)
		require.NoError(t, s.Release(ctx, Key{Name: "warm2-" + settle}, w.Token))
		w, err = s.Claim(ctx, ClaimRequest{Key: Key{Name: "warm3-" + settle}, Fingerprint: fp, OperationID: "op", Lease: time.Minute, Retention: time.Hour})
		require.NoError(t, err)
		require.NoError(t, s.Forget(ctx, Key{Name: "warm3-" + settle}, w.Token))

		k := Key{Name: settle}
		cl, err := s.Claim(ctx, ClaimRequest{Key: k, Fingerprint: fp, OperationID: "op", Lease: time.Minute, Retention: time.Hour})
		require.NoError(t, err)
		p.ResetOnNextRequest(true)
		switch settle {
		case "complete":
			require.NoError(t, s.Complete(ctx, k, cl.Token, Response{Status: 201}, time.Hour))
		case "release":
			require.ErrorIs(t, s.Release(ctx, k, cl.Token), ErrFenced)
		default:
			require.ErrorIs(t, s.Forget(ctx, k, cl.Token), ErrFenced)
		}
		next, err := s.Claim(ctx, ClaimRequest{Key: k, Fingerprint: fp, OperationID: "op_next", Lease: time.Minute, Retention: time.Hour})
		require.NoError(t, err)
		switch settle {
		case "complete":
			assert.Equal(t, Completed, next.State)
		case "release":
			assert.Equal(t, Owner, next.State)
			assert.Equal(t, 2, next.Attempt, "the release was applied")
			assert.False(t, next.Abandoned, "the release was applied")
		default:
			assert.Equal(t, Owner, next.State)
			assert.Equal(t, 1, next.Attempt, "the forget was applied")
		}
	}
}

// A completed record is one compact string; its replay still carries the
// operation ID and the response, and a different request still mismatches.
func TestRedisCompletedRecordLayout(t *testing.T) {
	redisBackends(t, func(t *testing.T, c *redis.Client) {
		s := newRedisStore(t, c)
		ctx := context.Background()
		k, fp := Key{Name: "layout"}, FingerprintOf("op", []byte("a"))
		claim, err := s.Claim(ctx, ClaimRequest{Key: k, Fingerprint: fp, OperationID: "op_layout", Lease: time.Minute, Retention: time.Hour})
		require.NoError(t, err)
		resp := Response{Status: 201, Header: map[string][]string{"A": {"1", "2"}}, Body: []byte("body\x00\xff")}
		require.NoError(t, s.Complete(ctx, k, claim.Token, resp, time.Hour))
		rec, _ := s.recordKey(k)
		assert.Equal(t, "string", c.Type(ctx, rec).Val())
		ttl := c.PTTL(ctx, rec).Val()
		assert.True(t, ttl > 59*time.Minute && ttl <= time.Hour, "retention %v", ttl)

		got, err := s.Claim(ctx, ClaimRequest{Key: k, Fingerprint: fp, OperationID: "op_x", Lease: time.Minute, Retention: time.Hour})
		require.NoError(t, err)
		assert.Equal(t, Claim{State: Completed, OperationID: "op_layout", Response: resp}, got)
		got, err = s.Claim(ctx, ClaimRequest{Key: k, Fingerprint: FingerprintOf("op", []byte("b")), OperationID: "op_y", Lease: time.Minute, Retention: time.Hour})
		require.NoError(t, err)
		assert.Equal(t, Mismatch, got.State)
		// (The same completion again succeeds, as a resend: see
		// TestRedisSettleRunTwice.)
		for _, err := range []error{
			s.Complete(ctx, k, claim.Token, Response{Status: 202}, time.Hour),
			s.Release(ctx, k, claim.Token),
			s.Heartbeat(ctx, k, claim.Token, time.Minute),
		} {
			assert.ErrorIs(t, err, ErrFenced)
		}
		_, err = s.Claim(ctx, ClaimRequest{Key: k, Fingerprint: fp, OperationID: strings.Repeat("x", 256), Lease: time.Minute, Retention: time.Hour})
		assert.Error(t, err, "an operation ID too long to store")
	})
}

// Operation IDs are arbitrary bytes: spaces, digits, newlines and NULs
// must not confuse the in-flight record's fields that follow them (see
// lua/record.lua).
func TestRedisRecordOddOperationIDs(t *testing.T) {
	redisBackends(t, func(t *testing.T, c *redis.Client) {
		s := newRedisStore(t, c)
		ctx := context.Background()
		k, fp := Key{Name: "odd"}, FingerprintOf("op", []byte("odd"))
		maker, taker := "op 1 2 3 11 \n\x00 x", " 9 9 9 10 "
		req := ClaimRequest{Key: k, Fingerprint: fp, OperationID: maker, Lease: time.Minute, Retention: time.Hour}
		first, err := s.Claim(ctx, req)
		require.NoError(t, err)
		again, err := s.Claim(ctx, req)
		require.NoError(t, err)
		assert.Equal(t, first, again, "the maker's claim run again")

		require.NoError(t, s.Abandon(ctx, k, first.Token))
		req.OperationID = taker
		took, err := s.Claim(ctx, req)
		require.NoError(t, err)
		assert.Equal(t, Claim{State: Owner, OperationID: maker, Attempt: 2, Token: took.Token, Abandoned: true}, took)
		assert.Greater(t, took.Token, first.Token)
		again, err = s.Claim(ctx, req)
		require.NoError(t, err)
		assert.Equal(t, took, again, "the taker's claim run again")

		resp := Response{Status: 201, Body: []byte("odd")}
		require.NoError(t, s.Complete(ctx, k, took.Token, resp, time.Hour))
		got, err := s.Claim(ctx, req)
		require.NoError(t, err)
		assert.Equal(t, Claim{State: Completed, OperationID: maker, Response: Response{Status: 201, Header: map[string][]string{}, Body: []byte("odd")}}, got)
	})
}

// CheckEviction tells a server that keeps the store's keys from one that may
// drop them, and the reason it matters: a completed record evicted from a
// server whose policy CheckEviction refuses is run again by its retry.
func TestRedisCheckEviction(t *testing.T) {
	ctx := t.Context()
	r := testserver.StartRedis(t)
	c := r.Client()
	s := newRedisStore(t, c)
	set := func(limit, policy string) {
		t.Helper()
		require.NoError(t, c.ConfigSet(ctx, "maxmemory", limit).Err())
		require.NoError(t, c.ConfigSet(ctx, "maxmemory-policy", policy).Err())
	}
	for _, tc := range []struct {
		limit, policy string
		keeps         bool
	}{
		{"0", "noeviction", true},
		{"0", "allkeys-lru", true}, // no limit: nothing is evicted
		{"64mb", "noeviction", true},
		{"64mb", "allkeys-lru", false},
		{"64mb", "volatile-lfu", false},
		{"64mb", "volatile-ttl", false},
	} {
		set(tc.limit, tc.policy)
		err := s.CheckEviction(ctx)
		if tc.keeps {
			assert.NoError(t, err, "maxmemory %s, %s", tc.limit, tc.policy)
			continue
		}
		require.Error(t, err, "maxmemory %s, %s", tc.limit, tc.policy)
		assert.NotErrorIs(t, err, ErrUnavailable)
		assert.ErrorContains(t, err, r.Addr)
		assert.ErrorContains(t, err, tc.policy)
	}

	// Why: with volatile-lru, a completed record (it has a TTL) is evicted
	// under memory pressure, and its retry runs the operation again.
	set("0", "noeviction")
	g := New(s, Options{})
	k, fp := Key{Name: "charge"}, FingerprintOf("op", nil)
	runs := 0
	fn := func(context.Context) (Response, error) { runs++; return Response{Status: 201}, nil }
	_, err := g.Do(ctx, k, fp, fn)
	require.NoError(t, err)
	used, err := strconv.ParseInt(c.InfoMap(ctx, "memory").Item("Memory", "used_memory"), 10, 64)
	require.NoError(t, err)
	set(strconv.FormatInt(used+1<<20, 10), "volatile-lru")
	rec, _ := s.recordKey(k)
	filler := strings.Repeat("x", 1024)
	for i := 0; c.Exists(ctx, rec).Val() == 1; i++ {
		require.Less(t, i, 100_000, "the record was never evicted")
		require.NoError(t, c.Set(ctx, "filler:"+strconv.Itoa(i), filler, time.Hour).Err())
	}
	require.Error(t, s.CheckEviction(ctx))
	_, err = g.Do(ctx, k, fp, fn)
	require.NoError(t, err)
	assert.Equal(t, 2, runs, "the evicted record's retry ran the operation again")
}

// A server that cannot be reached is ErrUnavailable; one that will not say
// (INFO denied by an ACL, or miniredis, which has no memory section) is
// reported as such, not as one that keeps its keys.
func TestRedisCheckEvictionUnknown(t *testing.T) {
	ctx := t.Context()
	r := testserver.StartRedis(t)
	admin := r.Client()
	require.NoError(t, admin.Do(ctx, "ACL", "SETUSER", "app", "on", ">pw", "~*", "&*", "+@all", "-info").Err())
	app := redis.NewClient(&redis.Options{Addr: r.Addr, Username: "app", Password: "pw"})
	t.Cleanup(func() { app.Close() })
	err := newRedisStore(t, app).CheckEviction(ctx)
	require.Error(t, err)
	assert.NotErrorIs(t, err, ErrUnavailable)
	assert.ErrorContains(t, err, "NOPERM")

	mini := redis.NewClient(&redis.Options{Addr: miniredis.RunT(t).Addr()})
	t.Cleanup(func() { mini.Close() })
	err = newRedisStore(t, mini).CheckEviction(ctx)
	require.Error(t, err)
	assert.NotErrorIs(t, err, ErrUnavailable)

	s := newRedisStore(t, admin)
	r.Stop(t)
	assert.ErrorIs(t, s.CheckEviction(ctx), ErrUnavailable)
}

package postgres_test

import (
	"context"
	_ "embed"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-go/idempotency"
	"github.com/idempotency-go/idempotency/idempotencytest"
	"github.com/idempotency-go/idempotency/postgres"
)

//go:embed testdata/schema-v3.sql
var schemaV3 string

// A rolling upgrade: instances of the previous version run operations on
// a table their schema made while instances of this version start,
// migrate it, and run the same operations beside them, duplicates of one
// key sent to both. Every operation runs once, and every duplicate gets
// its answer; the migration drops the CHECK constraints and the wake-up
// trigger; and afterwards a store whose every call goes to either
// version, at random, passes the conformance suite.
func testRollingUpgrade(t *testing.T, f *fixture) {
	ctx := t.Context()
	o := f.options()
	o.Table += ` "o'brien"` // quotes of both kinds, in identifiers and in literals
	first := postgres.New(f.pool, o)
	t.Cleanup(first.Close)
	require.NoError(t, first.MigrateWith(ctx, schemaV3))
	previous := newPreviousStore(f.pool, first, o)

	// Operations, each sent by two callers to instances of either version.
	var (
		runs           sync.Map // key name → *atomic.Int64
		upgraded       atomic.Bool
		stop           = make(chan struct{})
		wg             sync.WaitGroup
		ops, fromNewer atomic.Int64
	)
	guards := []*idempotency.Guard{idempotency.New(previous, idempotency.Options{Lease: 2 * time.Second})}
	var guardsMu sync.Mutex
	guardOf := func(i int) *idempotency.Guard {
		guardsMu.Lock()
		defer guardsMu.Unlock()
		return guards[i%len(guards)]
	}
	for w := range 8 {
		wg.Go(func() {
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				name := fmt.Sprintf("op-%d-%d", w, i)
				counter, _ := runs.LoadOrStore(name, new(atomic.Int64))
				var dup sync.WaitGroup
				answers := make([]idempotency.Response, 2)
				for d := range answers {
					dup.Go(func() {
						g := guardOf(w + i + d)
						r, err := g.Do(ctx, key(name), fp(name), func(context.Context) (idempotency.Response, error) {
							n := counter.(*atomic.Int64).Add(1)
							time.Sleep(5 * time.Millisecond)
							return idempotency.Response{Status: 201, Body: []byte(strconv.FormatInt(n, 10))}, nil
						})
						if assert.NoError(t, err, "operation %s", name) {
							answers[d] = r.Response
						}
					})
				}
				dup.Wait()
				assert.Equal(t, answers[0].Status, answers[1].Status, "the two callers of %s", name)
				assert.Equal(t, answers[0].Body, answers[1].Body, "the two callers of %s", name)
				ops.Add(1)
				if upgraded.Load() {
					fromNewer.Add(1)
				}
			}
		})
	}

	time.Sleep(300 * time.Millisecond)
	migrateConcurrently(t, f, o, 3)
	current := postgres.New(f.pool, o)
	t.Cleanup(current.Close)
	guardsMu.Lock()
	guards = append(guards, idempotency.New(current, idempotency.Options{Lease: 2 * time.Second}))
	guardsMu.Unlock()
	upgraded.Store(true)
	time.Sleep(700 * time.Millisecond)
	close(stop)
	wg.Wait()

	require.Positive(t, fromNewer.Load(), "no operation ran once both versions were serving")
	runs.Range(func(k, v any) bool {
		assert.EqualValues(t, 1, v.(*atomic.Int64).Load(), "runs of %s", k)
		return true
	})
	t.Logf("%d operations, %d of them while both versions served", ops.Load(), fromNewer.Load())

	var checks, triggers int
	require.NoError(t, f.pool.QueryRow(ctx, `SELECT
			(SELECT count(*) FROM pg_constraint WHERE conrelid = $1::regclass AND contype = 'c'),
			(SELECT count(*) FROM pg_trigger WHERE tgrelid = $1::regclass AND tgname LIKE '%settled')`,
		pgx.Identifier{o.Table}.Sanitize()).Scan(&checks, &triggers))
	assert.Zero(t, checks, "CHECK constraints left on the table")
	assert.Zero(t, triggers, "wake-up triggers left on the table")

	idempotencytest.Run(t, func(t *testing.T) idempotencytest.Harness {
		return idempotencytest.Harness{Store: &mixedStore{Store: current, previous: newPreviousStore(f.pool, current, o)}}
	})
}

package idempotency

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestOperationOutlivesClient: a client that gives up mid-run, through a
// real net/http server, does not abort the handler; its outcome is stored
// and the retry replays it. With CancelWithCaller the handler's context
// ends with the client, and what it then answers is its outcome (here a
// 503, which releases the key, so the retry runs it again).
func TestOperationOutlivesClient(t *testing.T) {
	eachStore(t, func(t *testing.T, newStore func(*testing.T) Store) {
		for _, withCaller := range []bool{false, true} {
			name := map[bool]string{false: "Default", true: "CancelWithCaller"}[withCaller]
			t.Run(name, func(t *testing.T) {
				var runs atomic.Int64
				started := make(chan struct{}, 2)
				finish := make(chan struct{})
				ended := make(chan error, 2) // the handler's context's cause when it returned
				g := New(newStore(t), Options{CancelWithCaller: withCaller})
				clientGone := make(chan (<-chan struct{}), 2) // each request's own net/http context
				guarded := g.Middleware(MiddlewareOptions{Scope: SingleTenant})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					n := runs.Add(1)
					started <- struct{}{}
					if n == 1 {
						select {
						case <-finish:
						case <-r.Context().Done():
						}
					}
					ended <- context.Cause(r.Context())
					if r.Context().Err() != nil {
						w.WriteHeader(http.StatusServiceUnavailable)
						return
					}
					w.WriteHeader(http.StatusCreated)
					io.WriteString(w, "charged")
				}))
				srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					clientGone <- r.Context().Done()
					guarded.ServeHTTP(w, r)
				}))
				t.Cleanup(srv.Close)

				post := func(ctx context.Context) (*http.Response, error) {
					req, err := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL+"/charges", strings.NewReader(`{"amount":1}`))
					require.NoError(t, err)
					req.Header.Set("Content-Type", "application/json")
					req.Header.Set(HeaderKey, "k")
					return srv.Client().Do(req)
				}
				ctx, giveUp := context.WithCancel(context.Background())
				first := make(chan error, 1)
				go func() {
					resp, err := post(ctx)
					if err == nil {
						resp.Body.Close()
					}
					first <- err
				}()
				<-started
				giveUp()
				require.ErrorIs(t, <-first, context.Canceled)
				if !withCaller {
					// Only once net/http has seen the client go, so that
					// the handler would have been cancelled by now.
					<-<-clientGone
					close(finish)
				}
				cause := <-ended

				resp, err := post(context.Background())
				require.NoError(t, err)
				body, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				assert.Equal(t, http.StatusCreated, resp.StatusCode)
				assert.Equal(t, "charged", string(body))
				if !withCaller {
					assert.NoError(t, cause, "the handler's context ended with the client")
					assert.Equal(t, int64(1), runs.Load())
					assert.Equal(t, "true", resp.Header.Get(HeaderReplayed), "the retry ran the handler again")
				} else {
					assert.ErrorIs(t, cause, context.Canceled)
					assert.Equal(t, int64(2), runs.Load())
					assert.Empty(t, resp.Header.Get(HeaderReplayed))
				}
			})
		}
	})
}

// TestDoOutlivesCaller: Do's own contract, without HTTP: fn keeps running
// after ctx ends, its outcome is stored, and Do returns it.
func TestDoOutlivesCaller(t *testing.T) {
	eachStore(t, func(t *testing.T, newStore func(*testing.T) Store) {
		g := New(newStore(t), Options{})
		ctx, cancel := context.WithCancel(context.Background())
		k := Key{Name: "k"}
		fp := FingerprintOf("charge", nil)
		res, err := g.Do(ctx, k, fp, func(fctx context.Context) (Response, error) {
			cancel()
			select {
			case <-fctx.Done():
				return Response{}, context.Cause(fctx)
			case <-time.After(20 * time.Millisecond):
			}
			return Response{Status: 201, Body: []byte("charged")}, nil
		})
		require.NoError(t, err)
		assert.Equal(t, "charged", string(res.Response.Body))
		res, err = g.Do(context.Background(), k, fp, func(context.Context) (Response, error) {
			return Response{}, errors.New("ran twice")
		})
		require.NoError(t, err)
		assert.True(t, res.Replayed)
		assert.Equal(t, "charged", string(res.Response.Body))
	})
}

// TestOperationTimeout: the run's context ends OperationTimeout after it
// starts, with context.DeadlineExceeded, whatever the caller's context; an
// error it then returns releases the key, as any error does.
func TestOperationTimeout(t *testing.T) {
	eachStore(t, func(t *testing.T, newStore func(*testing.T) Store) {
		g := New(newStore(t), Options{OperationTimeout: 30 * time.Millisecond})
		k := Key{Name: "k"}
		fp := FingerprintOf("charge", nil)
		_, err := g.Do(context.Background(), k, fp, func(ctx context.Context) (Response, error) {
			<-ctx.Done()
			return Response{}, ctx.Err()
		})
		require.ErrorIs(t, err, context.DeadlineExceeded)
		res, err := g.Do(context.Background(), k, fp, func(context.Context) (Response, error) {
			return Response{Status: 201}, nil
		})
		require.NoError(t, err)
		assert.False(t, res.Replayed, "the timed-out run's key was released for this one")
	})
}

// By default an operation runs at most a minute, so that a hung downstream
// call cannot hold its key in flight for as long as the process lives; a
// negative OperationTimeout leaves only the lease.
func TestOperationTimeoutDefault(t *testing.T) {
	deadline := func(o Options) (time.Duration, bool) {
		var left time.Duration
		var ok bool
		_, err := New(NewMemoryStore(MemoryOptions{}), o).Do(context.Background(), Key{Name: "k"}, Fingerprint{}, func(ctx context.Context) (Response, error) {
			var d time.Time
			d, ok = ctx.Deadline()
			left = time.Until(d)
			return Response{}, nil
		})
		require.NoError(t, err)
		return left, ok
	}
	left, ok := deadline(Options{})
	require.True(t, ok, "the default bounds the run")
	assert.InDelta(t, time.Minute.Seconds(), left.Seconds(), 5)
	_, ok = deadline(Options{OperationTimeout: -1})
	assert.False(t, ok, "a negative OperationTimeout leaves no deadline")
}

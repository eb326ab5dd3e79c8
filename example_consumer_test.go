package idempotency_test

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"

	"github.com/idempotency-go/idempotency"
)

// A consumer of a queue that delivers at least once: the message ID is the
// key, and a message is acknowledged only once its outcome is stored. A
// redelivery while the first delivery still runs (its visibility timeout
// ran out, say) is not run beside it: with a WaitTimeout it waits for the
// outcome; with WaitTimeout < 0, as here, it is skipped at once and left
// unacknowledged, and its next delivery is answered from the record.
func Example_queueConsumer() {
	guard := idempotency.New(idempotency.NewMemoryStore(idempotency.MemoryOptions{}),
		idempotency.Options{WaitTimeout: -1})
	type message struct{ ID, Payload string }
	charging, finish := make(chan struct{}), make(chan struct{})

	// handle returns whether to acknowledge the message.
	handle := func(ctx context.Context, m message) bool {
		res, err := guard.Do(ctx, idempotency.Key{Scope: "payments", Name: m.ID},
			idempotency.FingerprintOf("charge", []byte(m.Payload)),
			func(ctx context.Context) (idempotency.Response, error) {
				close(charging)
				<-finish // the gateway is slow
				return idempotency.Response{Body: []byte("ch_1")}, nil
			})
		switch {
		case errors.Is(err, idempotency.ErrInFlight):
			fmt.Println(m.ID, "in flight elsewhere: not acknowledged, redelivered later")
			return false
		case errors.Is(err, idempotency.ErrMismatch):
			fmt.Println(m.ID, "reused for another payload: to the dead-letter queue")
			return true
		case err != nil:
			// The store failed, or the outcome could not be stored: a
			// redelivery finds out from the record what happened.
			fmt.Println(m.ID, "not acknowledged:", err)
			return false
		}
		fmt.Printf("%s charged %s (replayed=%v): acknowledged\n", m.ID, res.Response.Body, res.Replayed)
		return true
	}

	ctx := context.Background()
	m := message{ID: "msg-1", Payload: `{"amount":100}`}
	first := make(chan bool)
	go func() { first <- handle(ctx, m) }()
	<-charging
	handle(ctx, m) // redelivered during the run
	close(finish)
	<-first
	handle(ctx, m) // redelivered again, after the outcome was stored
	// Output:
	// msg-1 in flight elsewhere: not acknowledged, redelivered later
	// msg-1 charged ch_1 (replayed=false): acknowledged
	// msg-1 charged ch_1 (replayed=true): acknowledged
}

// A webhook receiver: the sender's event ID, read from the body, is the key,
// so the middleware (which reads Idempotency-Key) does not apply; Guard.Do
// does. The signature is checked before anything is claimed: an unsigned
// request must not be able to occupy an event ID. The sender retries
// whatever is not 2xx, so 2xx goes out only once the outcome is stored.
func Example_webhookReceiver() {
	secret := []byte("whsec_test")
	guard := idempotency.New(idempotency.NewMemoryStore(idempotency.MemoryOptions{}), idempotency.Options{})
	fulfilled := 0

	receive := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, 1<<20))
		if err != nil {
			http.Error(w, "unreadable body", http.StatusBadRequest)
			return
		}
		mac := hmac.New(sha256.New, secret)
		mac.Write(body)
		sig, err := hex.DecodeString(r.Header.Get("Webhook-Signature"))
		if err != nil || !hmac.Equal(sig, mac.Sum(nil)) {
			http.Error(w, "bad signature", http.StatusBadRequest)
			return
		}
		var event struct{ ID, Type string }
		if err := json.Unmarshal(body, &event); err != nil || event.ID == "" {
			http.Error(w, "not an event", http.StatusBadRequest)
			return
		}
		_, err = guard.Do(r.Context(), idempotency.Key{Scope: "sender:acme", Name: event.ID},
			idempotency.FingerprintOf("webhook", body),
			func(ctx context.Context) (idempotency.Response, error) {
				fulfilled++ // ship the order
				return idempotency.Response{Status: http.StatusOK}, nil
			})
		switch {
		case errors.Is(err, idempotency.ErrInvalidKey):
			http.Error(w, "event ID not usable as a key", http.StatusBadRequest)
		case errors.Is(err, idempotency.ErrMismatch):
			http.Error(w, "event ID reused", http.StatusUnprocessableEntity)
		case err != nil: // in flight, or the store failed: let the sender retry
			http.Error(w, "try again", http.StatusServiceUnavailable)
		default:
			w.WriteHeader(http.StatusOK)
		}
	})
	srv := httptest.NewServer(receive)
	defer srv.Close()

	deliver := func(body string, key []byte) {
		mac := hmac.New(sha256.New, key)
		mac.Write([]byte(body))
		req, _ := http.NewRequest(http.MethodPost, srv.URL, strings.NewReader(body))
		req.Header.Set("Webhook-Signature", hex.EncodeToString(mac.Sum(nil)))
		res, err := srv.Client().Do(req)
		if err != nil {
			fmt.Println(err)
			return
		}
		res.Body.Close()
		fmt.Println(res.StatusCode)
	}
	event := `{"id":"evt_1","type":"order.paid"}`
	deliver(event, []byte("forged"))                          // refused before any claim
	deliver(event, secret)                                    // fulfilled
	deliver(event, secret)                                    // the sender's retry: answered from the record
	deliver(`{"id":"evt_1","type":"order.refunded"}`, secret) // another event under a used ID
	fmt.Println("fulfilled:", fulfilled)
	// Output:
	// 400
	// 200
	// 200
	// 422
	// fulfilled: 1
}

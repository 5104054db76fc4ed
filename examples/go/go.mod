module github.com/kvrouter/kvrouter/examples/go

go 1.23.0

require (
	github.com/kvrouter/kvrouter/bindings/go v0.2.0
	github.com/kvrouter/kvrouter/bindings/go/kvrouterprom v0.2.0
	github.com/prometheus/client_golang v1.23.2
)

require (
	github.com/beorn7/perks v1.0.1 // indirect
	github.com/cespare/xxhash/v2 v2.3.0 // indirect
	github.com/kylelemons/godebug v1.1.0 // indirect
	github.com/munnerz/goautoneg v0.0.0-20191010083416-a7dc8b61c822 // indirect
	github.com/prometheus/client_model v0.6.2 // indirect
	github.com/prometheus/common v0.66.1 // indirect
	github.com/prometheus/procfs v0.16.1 // indirect
	go.yaml.in/yaml/v2 v2.4.2 // indirect
	golang.org/x/sys v0.35.0 // indirect
	google.golang.org/protobuf v1.36.8 // indirect
)

// The binding and its Prometheus collector from this checkout.
replace (
	github.com/kvrouter/kvrouter/bindings/go => ../../bindings/go
	github.com/kvrouter/kvrouter/bindings/go/kvrouterprom => ../../bindings/go/kvrouterprom
)

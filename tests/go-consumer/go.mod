module example.com/kvrouter-go-consumer

go 1.21

require github.com/kvrouter/kvrouter/bindings/go v0.2.0

replace github.com/kvrouter/kvrouter/bindings/go => ../../bindings/go

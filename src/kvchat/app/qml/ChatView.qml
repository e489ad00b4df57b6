// The conversation: a ListView over the Python ChatModel. It follows a streaming reply only while
// the reader is at the bottom; scrolled up, it stays put and offers a jump back.
import QtQuick
import QtQuick.Controls

Rectangle {
    id: root
    color: theme.colours.bg

    ListView {
        id: list
        objectName: "messages"
        anchors.fill: parent
        model: chatModel
        cacheBuffer: 1200
        boundsBehavior: Flickable.StopAtBounds
        header: Item { height: 16 }
        footer: Item { height: 16 }
        clip: true
        // set only by the reader's own scrolling (programmatic moves are flagged)
        property bool follow: true
        property bool programmatic: false

        delegate: MessageDelegate {}

        ScrollBar.vertical: ScrollBar { policy: ScrollBar.AsNeeded }

        function atEnd() { return contentY + height >= contentHeight + originY - 24 }
        function toEnd() {
            programmatic = true
            positionViewAtEnd()
            programmatic = false
            follow = true
        }
        onContentYChanged: if (!programmatic && (moving || dragging || scrollGrab.active)) follow = atEnd()
        onMovementEnded: follow = atEnd()
        // checked again when it runs: the reader may have scrolled away since it was queued
        function keepUp() { if (follow && !moving && !dragging) toEnd() }
        onContentHeightChanged: if (follow) Qt.callLater(keepUp)
        onCountChanged: if (follow) Qt.callLater(keepUp)
        onHeightChanged: if (follow) Qt.callLater(keepUp)  // a shrinking window keeps the latest in view

        // a wheel turn moves contentY without "moving" on some platforms: count it as the reader's
        WheelHandler {
            id: scrollGrab
            property bool active: false
            target: null
            onWheel: (event) => {
                active = true
                list.flick(0, event.angleDelta.y * 8)
                active = false
            }
        }

        Connections {
            target: chatModel
            function onFollow() { list.follow = true; Qt.callLater(list.toEnd) }
        }
    }

    RoundButton {
        id: jump
        objectName: "jumpToLatest"
        visible: !list.follow && list.count > 0
        anchors.horizontalCenter: parent.horizontalCenter
        anchors.bottom: parent.bottom
        anchors.bottomMargin: 14
        text: "Jump to latest"
        icon.source: iconDir + "/arrow-down.svg"
        icon.color: theme.colours.text
        palette.button: theme.colours.panel
        palette.buttonText: theme.colours.text
        onClicked: list.toEnd()
    }

    EmptyState {
        anchors.fill: parent
        visible: list.count === 0
    }
}
